"""The settings lit-rl's vLLM engines share, built by their configs (`VLLMColocate`, `VLLMServer` in
`lit_rl.rollout.engine_config`), and their checks, which name the user's keys (`model.rollout.engine.<option>`).
Plain data: importing it imports no vLLM."""

from __future__ import annotations

import importlib.util
import math
import urllib.parse
from dataclasses import dataclass
from typing import Literal, Optional

import torch

from lit_rl.errors import ConfigError

# vLLM's dtype names (`model.rollout.engine.dtype`) as torch dtypes; the first name of each dtype is the one lit-rl
# passes.
VLLM_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float": torch.float32,
    "half": torch.float16,
}

COLLECTIVE_TRANSFERS = ("gloo", "nccl")  # `weight_transfer`s that broadcast to the servers' workers
# The backend a server's `--weight-transfer-config` names for each of them.
VLLM_TRANSFER_BACKENDS = {"gloo": "lit_rl_gloo", "nccl": "nccl"}
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclass
class VLLMConfig:
    """Rollouts with vLLM instead of HF `generate`: `--config configs/rollout/vllm_{colocate,server}.yaml`.

    Args:
        mode: `colocate`: an in-process `vllm.LLM` on each trainer rank's device. `server`: a separately started
            vLLM OpenAI-compatible server (see the README for the command); rank 0 talks to it.
        gpu_memory_utilization: (colocate, GPU) share of the GPU vLLM may take for weights and KV cache.
        tensor_parallel_size: GPUs one engine spans. Colocated: consecutive trainer ranks (a divisor of the
            ranks per node) serve one engine together and split its completions; 1: an engine per rank.
        max_model_len: (colocate) context vLLM reserves KV cache for; None: the model's context.
        dtype: vLLM's dtype. Colocated: `auto` follows the trainer's compute dtype (bf16 under `bf16-mixed`). Server:
            the dtype the server was started with, if known (`auto`: unknown), for `model.rollout.correction: auto`.
        enable_prefix_caching: (colocate) reuse the KV cache of shared prompt prefixes (the G completions of a
            prompt share it). The cache is reset after every weight push.
        enable_sleep_mode: (colocate, GPU) release vLLM's GPU memory between rollouts (weights and KV cache, sleep
            level 2; the next push refills the weights) so the policy's update has it.
        enforce_eager: (colocate) no CUDA graphs / compilation; None: True on CPU (compiling costs more than it
            saves there), False on GPU.
        cpu_kvcache_space_gib: (colocate, CPU) KV cache size in GiB (`VLLM_CPU_KVCACHE_SPACE`).
        server_url: (server) base URL of the server. Bind it to 127.0.0.1 unless it must be reached from elsewhere.
        server_urls: (server) several servers, data-parallel (instead of `server_url`): each generation's requests
            (one per prompt, its completions seeded from the request's seed) are dealt out across them, so which
            server samples a completion does not change it; every weight push goes to all of them.
        on_server_failure: (server) what a server that stops answering does to the run: `fail` (default) stops it
            with one line naming the URL; `continue` warns in one line and deals that server's requests (and its
            share of later generations) to the others; the run stops only when none is left. Servers are
            health-checked before each generation; one out of service that answers again is taken back at the
            next weight push, with the weights.
        request_timeout_s: (server) seconds one HTTP request may take before it counts as failed.
        max_retries: (server) attempts after the first for a request that failed to connect, timed out, or got a
            5xx answer; waits 1, 2, 4, ... seconds in between (uploads to a weight receiver: 0.5, 1, 2, ...). Then
            the run stops with an error naming the URL.
        wait_for_server_s: (server) how long the first request waits for a server that is still starting.
        push_bucket_mib: weights are gathered (ZeRO-3) and pushed a bucket of at most this many MiB at a time,
            so no rank holds a second full copy of the model (see `lit_rl.rollout.weights`). The server engine
            writes one file per bucket.
        weight_sync_dir: (server) directory, shared with the server, where rank 0 writes the policy's weights
            before asking the server to reload them; None: a fresh directory under /dev/shm (or the temp dir).
            With `weight_transfer: http`, the local directory the files are written to before the upload.
        weight_transfer: (server) how the weights reach the server: `file` (written into `weight_sync_dir`, which
            the server must see: the same machine or a shared file system), `http` (uploaded to the weight
            receiver at `weights_url`, which runs beside a server on another machine:
            `lit_rl.rollout.server.weight_receiver`), `gloo` or `nccl` (broadcast from rank 0 to the server's workers
            through vLLM's weight-transfer endpoints: no file, no disk; `lit_rl.rollout.server.collective_transfer`), or
            `auto` (default): `http` when `weights_url` is set, else `file`. `gloo` works on CPU and GPU and needs
            lit-rl installed beside the server (it registers the engine with vLLM) and the server started with
            `--weight-transfer-config '{"backend": "lit_rl_gloo"}'`; `nccl` is vLLM's own engine
            (`--weight-transfer-config '{"backend": "nccl"}'`) and needs GPUs on both sides.
        weights_url: (server) the weight receiver's URL (`python -m lit_rl.rollout.server.weight_receiver` on the
            server's machine), e.g. `http://10.0.0.2:8010`.
        weights_urls: (server) with `server_urls`: the receiver beside each server, in the same order. Servers on
            one machine may share one (it is uploaded to once per push); `weights_url` alone serves them all.
        transfer_address: (`gloo`, `nccl`) this machine's address as the servers reach it: rank 0 hosts the
            rendezvous of each server's transfer group there, listening on that address alone (under `gloo`
            only until the workers have joined). 127.0.0.1 serves servers on this machine only.
        transfer_port: (`gloo`, `nccl`) the port of the first server's rendezvous, the next server's one above, and
            so on; 0 (default): free ports.
    """

    mode: Literal["colocate", "server"] = "colocate"
    gpu_memory_utilization: float = 0.3
    tensor_parallel_size: int = 1
    max_model_len: Optional[int] = None
    dtype: str = "auto"
    enable_prefix_caching: bool = True
    enable_sleep_mode: bool = False
    enforce_eager: Optional[bool] = None
    cpu_kvcache_space_gib: int = 1
    server_url: str = "http://127.0.0.1:8000"
    server_urls: Optional[list[str]] = None
    on_server_failure: Literal["fail", "continue"] = "fail"
    request_timeout_s: float = 300.0
    max_retries: int = 3
    wait_for_server_s: float = 60.0
    weight_sync_dir: Optional[str] = None
    push_bucket_mib: float = 512.0
    weight_transfer: Literal["auto", "file", "http", "gloo", "nccl"] = "auto"
    weights_url: Optional[str] = None
    weights_urls: Optional[list[str]] = None
    transfer_address: str = "127.0.0.1"
    transfer_port: int = 0

    @property
    def uploads_weights(self) -> bool:
        """Whether the server engine uploads the weights to a receiver (`weight_transfer`)."""
        has_url = self.weights_url is not None or self.weights_urls is not None
        return self.weight_transfer == "http" or (self.weight_transfer == "auto" and has_url)

    @property
    def broadcasts_weights(self) -> bool:
        """Whether the server engine broadcasts the weights to the servers' workers (`gloo`, `nccl`)."""
        return self.weight_transfer in COLLECTIVE_TRANSFERS

    def server_endpoints(self) -> list[tuple[str, Optional[str]]]:
        """(server URL, its weight receiver's URL or None) for every server, `server_urls` over `server_url`."""
        servers = [url.rstrip("/") for url in (self.server_urls or [self.server_url])]
        if not self.uploads_weights:
            return [(url, None) for url in servers]
        receivers = list(self.weights_urls) if self.weights_urls else [self.weights_url] * len(servers)
        return list(zip(servers, [url.rstrip("/") for url in receivers]))  # one receiver, however it is spelled


def check_vllm_config(config: Optional[VLLMConfig]) -> None:
    """Reject impossible settings at construction, naming the offending `model.rollout.engine.<option>`."""
    if config is None:
        return
    if config.mode not in ("colocate", "server"):
        raise ConfigError(f"VLLMConfig.mode must be 'colocate' or 'server', got {config.mode!r}")  # built by lit-rl
    if not 0 < config.gpu_memory_utilization <= 1:
        raise ConfigError(
            f"model.rollout.engine.gpu_memory_utilization must be in (0, 1], got {config.gpu_memory_utilization}"
        )
    if config.tensor_parallel_size < 1:
        raise ConfigError(f"model.rollout.engine.tensor_parallel_size must be >= 1, got {config.tensor_parallel_size}")
    if not (0 < config.push_bucket_mib < math.inf):
        raise ConfigError(
            f"model.rollout.engine.push_bucket_mib must be a finite number of MiB > 0, got {config.push_bucket_mib}"
        )
    if config.max_model_len is not None and config.max_model_len < 1:
        raise ConfigError(f"model.rollout.engine.max_model_len must be >= 1, got {config.max_model_len}")
    if config.cpu_kvcache_space_gib < 1:
        raise ConfigError(
            f"model.rollout.engine.cpu_kvcache_space_gib must be >= 1 (whole GiB), got {config.cpu_kvcache_space_gib}"
        )
    if not config.server_url.startswith(("http://", "https://")):
        raise ConfigError(
            f"model.rollout.engine.server_url must start with http:// or https://, got {config.server_url!r}"
        )
    if not (0 < config.request_timeout_s < math.inf):
        raise ConfigError(
            "model.rollout.engine.request_timeout_s must be a finite number of seconds > 0, got "
            f"{config.request_timeout_s}"
        )
    if not (0 <= config.wait_for_server_s < math.inf):
        raise ConfigError(
            "model.rollout.engine.wait_for_server_s must be a finite number of seconds >= 0, got "
            f"{config.wait_for_server_s}"
        )
    if config.max_retries < 0:
        raise ConfigError(f"model.rollout.engine.max_retries must be >= 0, got {config.max_retries}")
    if config.weight_transfer not in ("auto", "file", "http", *COLLECTIVE_TRANSFERS):
        raise ConfigError(
            "model.rollout.engine.transfer.method must be auto, file, http, gloo or nccl, got "
            f"{config.weight_transfer!r}"
        )
    _check_server_lists(config)
    if config.broadcasts_weights:
        _check_collective_transfer(config)
        return
    if config.weight_transfer == "http" and config.weights_url is None and config.weights_urls is None:
        raise ConfigError(
            "model.rollout.engine.transfer.method: http needs model.rollout.engine.transfer.receiver_url, the "
            "weight receiver beside the server "
            "(python -m lit_rl.rollout.server.weight_receiver --dir DIR --port 8010 on the server's machine)"
        )
    if config.weights_url is not None and not config.weights_url.startswith(("http://", "https://")):
        raise ConfigError(
            "model.rollout.engine.transfer.receiver_url must start with http:// or https://, got "
            f"{config.weights_url!r}"
        )
    remote = _server_elsewhere(config)
    if config.mode == "server" and not config.uploads_weights and config.weight_sync_dir is None and remote:
        raise ConfigError(
            f"model.rollout.engine.server_url {remote} is not on this machine: its weights cannot go through "
            "a local /dev/shm directory. Run the weight receiver beside it and set "
            "model.rollout.engine.transfer.receiver_url, "
            "or set model.rollout.engine.transfer.sync_dir to a file system both machines share"
        )


def _server_elsewhere(config: VLLMConfig) -> Optional[str]:
    """The first server URL whose host is not this machine (127.0.0.1, localhost, ::1), or None."""
    for url, _ in config.server_endpoints():
        if (urllib.parse.urlparse(url).hostname or "") not in LOCAL_HOSTS:
            return url
    return None


_USER_KEYS = {
    "server_urls": "model.rollout.engine.server_urls",
    "weights_urls": "model.rollout.engine.transfer.receiver_urls",
}


def _check_server_lists(config: VLLMConfig) -> None:
    """`server_urls`, `weights_urls` and `on_server_failure`, each named when wrong."""
    if config.on_server_failure not in ("fail", "continue"):
        raise ConfigError(
            f"model.rollout.engine.on_server_failure must be fail or continue, got {config.on_server_failure!r}"
        )
    for key in ("server_urls", "weights_urls"):
        urls = getattr(config, key)
        if urls is None:
            continue
        if isinstance(urls, str) or not urls:
            raise ConfigError(f"{_USER_KEYS[key]} must be a non-empty list of URLs, got {urls!r}")
        for url in urls:
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ConfigError(f"{_USER_KEYS[key]}: each URL must start with http:// or https://, got {url!r}")
        if key == "server_urls" and len({url.rstrip("/") for url in urls}) != len(urls):
            raise ConfigError(f"model.rollout.engine.server_urls lists a server twice: {urls}")
    if config.weights_urls is not None:
        if config.server_urls is None or len(config.weights_urls) != len(config.server_urls):
            raise ConfigError(
                "model.rollout.engine.transfer.receiver_urls needs model.rollout.engine.server_urls with as "
                "many entries (one receiver per server, "
                f"in the same order); got {len(config.weights_urls)} for "
                f"{len(config.server_urls) if config.server_urls else 'no'} server_urls"
            )
        if config.weights_url is not None:
            raise ConfigError(
                "set model.rollout.engine.transfer.receiver_url or "
                "model.rollout.engine.transfer.receiver_urls, not both"
            )


def _check_collective_transfer(config: VLLMConfig) -> None:
    """`weight_transfer: gloo | nccl`: no receiver to upload to, a port in range, and an address other machines
    can reach when a server is on one."""
    if config.weights_url is not None or config.weights_urls is not None:
        raise ConfigError(
            "model.rollout.engine.transfer.receiver_url(s) is for transfer.method: http; with "
            f"{config.weight_transfer} the weights are "
            "broadcast to the servers' workers: unset it"
        )
    if config.transfer_address in ("0.0.0.0", "::", ""):
        raise ConfigError(
            f"model.rollout.engine.transfer.address must be this machine's address as the servers reach it, not "
            f"{config.transfer_address!r}"
        )
    if config.weight_transfer == "nccl" and config.mode == "server":
        if not torch.cuda.is_available():
            raise ConfigError(
                "model.rollout.engine.transfer.method: nccl needs a CUDA GPU beside the trainer; use gloo"
            )
        if importlib.util.find_spec("vllm") is None:
            raise ConfigError(
                "model.rollout.engine.transfer.method: nccl needs vLLM installed beside the trainer; use gloo"
            )
    if not 0 <= config.transfer_port <= 65535:
        raise ConfigError(
            f"model.rollout.engine.transfer.port must be in 0..65535 (0: free ports), got {config.transfer_port}"
        )
    if config.transfer_port and config.transfer_port + len(config.server_endpoints()) - 1 > 65535:
        raise ConfigError(
            f"model.rollout.engine.transfer.port {config.transfer_port} leaves no port for each of the "
            f"{len(config.server_endpoints())} servers (one port each, counting up)"
        )
    remote = _server_elsewhere(config)
    if config.transfer_address in LOCAL_HOSTS and remote:
        raise ConfigError(
            f"model.rollout.engine.server_url {remote} is not on this machine: set "
            "model.rollout.engine.transfer.address to this "
            f"machine's address that it can reach (the weights' rendezvous), not {config.transfer_address}"
        )
