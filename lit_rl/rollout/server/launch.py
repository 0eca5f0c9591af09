"""`model.rollout.engine.launch: true`: the trainer starts its own vLLM server, so a run on a server (asynchronous
rollouts, agentic episodes) is one command:

    lit-rl fit --config configs/grpo.yaml --config configs/rollout/vllm_server.yaml --model.rollout.engine.launch true

Rank 0 starts `server_command` (the documented command: loopback, vLLM's RL endpoints, the log-probs the trainer
recomputes) on 127.0.0.1 at a free port (another if another process takes it first; every rank learns rank 0's),
serving the policy's `model_name_or_path`, when the engine is first built; its first weight push then gives it the
policy's current weights (a resumed run's too). The server is stopped with
the engine, and never outlives the trainer (`LocalVLLMServer`). Imports no vLLM.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from typing import Optional, Sequence

import torch

from lit_rl.errors import ConfigError
from lit_rl.resume import say
from lit_rl.rollout.engine_config import ENGINE_KEY as KEY
from lit_rl.rollout.engine_config import VLLMServer
from lit_rl.rollout.server.client import LocalVLLMServer

LOG_NAME = "vllm_server.log"
NOT_STARTED_URL = "http://127.0.0.1:0"  # a launched server's until it started (port 0: no server listens there)
# Flags `server_command` sets (they come last, so they win anyway): a second value would fight lit-rl's, and
# `--host` would expose the server. vLLM's parser also takes a flag's prefix and `_` for `-`: so are they checked.
OWN_FLAGS = (
    "--model",
    "--host",
    "--port",
    "--served-model-name",
    "--weight-transfer-config",
    "--logprobs-mode",
    "--generation-config",
    "--trust-remote-code",
)


def own_flag(arg: str) -> Optional[str]:
    """The lit-rl flag `arg` would set in vLLM's parser (a flag, its prefix, or either with `_`), else None."""
    flag = arg.split("=", 1)[0].replace("_", "-")
    if not flag.startswith("--") or len(flag) < 3:
        return None
    return next((own for own in OWN_FLAGS if own.startswith(flag)), None)


def check_launch(config: VLLMServer) -> None:
    """Refuse launch settings that cannot work, naming the key."""
    launch, launch_args, timeout_s, dtype = config.launch, config.launch_args, config.launch_timeout_s, config.dtype
    if launch_args and not launch:
        raise ConfigError(f"{KEY}.launch_args is set but {KEY}.launch is false: nothing is launched")
    if dtype != "auto":
        raise ConfigError(
            f"{KEY}.dtype describes a server started elsewhere; a launched server's dtype is given to it: "
            f'{KEY}.launch_args \'["--dtype", "{dtype}"]\''
        )
    if config.server_urls:
        raise ConfigError(
            f"{KEY}.launch starts one server on this machine; {KEY}.server_urls names servers started elsewhere: "
            "set one of them"
        )
    if config.uploads_weights:
        raise ConfigError(
            f"{KEY}.launch starts the server on this machine: its weights go through files (transfer.method: file, "
            "the default) or a broadcast (gloo), not through a weight receiver (transfer.method: http)"
        )
    if not (0 < timeout_s < math.inf):
        raise ConfigError(f"{KEY}.launch_timeout_s must be a finite number of seconds > 0, got {timeout_s}")
    for arg in launch_args or []:
        if not isinstance(arg, str):
            raise ConfigError(f"{KEY}.launch_args must be strings (flags and their values), got {arg!r}")
        flag = own_flag(arg)
        if flag is not None:
            where = "model.policy.trust_remote_code" if flag == "--trust-remote-code" else "lit-rl"
            raise ConfigError(f"{KEY}.launch_args: {arg} ({flag}) is set by {where} for the launched server")


def launched_dtype(launch_args: Sequence[str]) -> str:
    """The dtype the launched server computes in, as vLLM names it: `--dtype` in `launch_args`, else float32 on a
    machine without CUDA (`server_command`), else `auto` (the model's own: not known here)."""
    for index, arg in enumerate(launch_args):
        if arg.startswith("--dtype="):
            return arg.split("=", 1)[1]
        if arg == "--dtype" and index + 1 < len(launch_args):
            return launch_args[index + 1]
    return "auto" if torch.cuda.is_available() else "float32"


class ServerLauncher:
    """Starts the run's server on rank 0 (`start`) and stops it (`stop`); `url` is known once it started.

    Args:
        model: what the server loads (the policy's resolved `model_name_or_path`).
        log_dir: where `vllm_server.log` goes (the run's log directory); None: a new temporary directory.
        extra_args: `launch_args`.
        timeout_s: `launch_timeout_s`.
        weight_transfer: `transfer.method`; gloo and nccl start the server with the matching
            `--weight-transfer-config`.
    """

    def __init__(
        self,
        model: str,
        log_dir: Optional[str],
        extra_args: Sequence[str],
        timeout_s: float,
        weight_transfer: str,
        trust_remote_code: bool = False,
    ) -> None:
        self.model = model
        self.trust_remote_code = trust_remote_code
        self.trainer_share: Optional[tuple[int, Optional[set[int]]]] = None  # what the trainer had before sharing
        self.log_dir = log_dir
        self.extra_args = list(extra_args)
        self.timeout_s = timeout_s
        self.weight_transfer = weight_transfer
        self.server: Optional[LocalVLLMServer] = None

    @property
    def url(self) -> Optional[str]:
        """Where the started server listens (the port it bound), None before `start`."""
        return None if self.server is None else self.server.url

    def start(self) -> None:
        log_dir = self.log_dir or tempfile.mkdtemp(prefix="lit-rl-vllm-server-")
        os.makedirs(log_dir, exist_ok=True)
        log = os.path.abspath(os.path.join(log_dir, LOG_NAME))
        say(f"starting a vLLM server for {self.model} on 127.0.0.1 ({KEY}.launch; its log: {log})")
        cpu = not torch.cuda.is_available()
        split = core_split() if cpu else None  # (the trainer's cores, the server's)
        started = time.monotonic()
        self.server = LocalVLLMServer(
            self.model,
            log,
            cpu=cpu,
            extra_args=self.extra_args,
            timeout_s=self.timeout_s,
            weight_transfer=self.weight_transfer,
            trust_remote_code=self.trust_remote_code,
            cpus=None if split is None else split[1],
        )
        say(f"vLLM server ready on {self.url} after {time.monotonic() - started:.0f} s; it stops when the run ends")
        if cpu:
            self.trainer_share = share_cores(None if split is None else split[0])

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self.trainer_share is not None:  # the cores are the trainer's again
            threads, cores = self.trainer_share
            torch.set_num_threads(threads)
            if cores is not None:
                _pin_threads(cores)
            self.trainer_share = None


def core_split() -> Optional[tuple[set[int], set[int]]]:
    """On CPU, the cores this process may use split in two, the trainer's (the first half) and the server's, when
    there are two or more and the user has not placed the processes (`OMP_NUM_THREADS`,
    `VLLM_CPU_OMP_THREADS_BIND`); None otherwise (not Linux, one core)."""
    if not hasattr(os, "sched_getaffinity") or {"OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND"} & set(os.environ):
        return None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None
    half = len(cores) // 2
    return set(cores[:half]), set(cores[half:])


def share_cores(cores: Optional[set[int]]) -> Optional[tuple[int, Optional[set[int]]]]:
    """On CPU the server and the trainer share the machine: the trainer takes half its threads, unless the user set
    them (`OMP_NUM_THREADS`), and with `cores` (`core_split`) moves every thread of its process onto them, while the
    server runs on the others. Returns what to restore (its thread count, and its cores when it moved), or None.
    With every thread each, their idle threads spin against each other's work (on 2 cores the shipped GRPO config
    took 1.56 s a step against 0.67 s); with both sampling and training at once (asynchronous rollouts), their
    threads also take each other's cores, which pinning avoids."""
    threads = torch.get_num_threads()
    if threads < 2 or "OMP_NUM_THREADS" in os.environ:
        return None
    share = threads // 2 if cores is None else len(cores)
    torch.set_num_threads(share)
    previous = None
    if cores is not None:
        previous = os.sched_getaffinity(0)
        _pin_threads(cores)
    where = "" if cores is None else f" (cores {_cpu_list(cores)}; the server's: the others)"
    say(f"the trainer now computes on {share} of its {threads} CPU threads{where}: the server has the rest")
    return threads, previous


def _pin_threads(cores: set[int]) -> None:
    """Every thread of this process onto `cores` (a thread's affinity is its own on Linux; new ones inherit it)."""
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cores)
        except OSError:  # a thread that ended meanwhile
            pass


def _cpu_list(cores: set[int]) -> str:
    return ",".join(str(core) for core in sorted(cores))
