"""Rollouts from a separately started vLLM server, over HTTP. Imports no vLLM: the trainer needs none installed.

Start the server (same machine or one that shares `transfer.sync_dir`), bound to 127.0.0.1 unless it must be
reached from elsewhere:

    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model <policy> --served-model-name policy \
        --host 127.0.0.1 --port 8000 --logprobs-mode processed_logprobs --generation-config vllm

`VLLM_SERVER_DEV_MODE=1` enables vLLM's RL endpoints (`/pause`, `/resume`, `/collective_rpc`, ...).

A generation (`generate`) is rank 0's: every rank's prompts (and per-completion seeds) are gathered to it, it sends
one request per run of identical prompts (`n` completions; vLLM gives child `i` the seed `seed + i`), and the
completions are scattered back. Independent episodes' turns (`concurrent_generate`) go from each rank straight to
the servers, with no collective: every rank follows rank 0's view of the servers (their URLs, model names, and
which are in service), shared when it connects and with every push. A weight push writes the policy's weights as
safetensors into `transfer.sync_dir`, one file per `push_bucket_mib` (rank 0 never holds more than about one bucket of
gathered weights; the other ranks take part in the gathers), then asks the server to pause, reload from there
(`collective_rpc("reload_weights")`), reset its prefix cache and resume. With `transfer.method: gloo | nccl` the
weights are broadcast to the servers' workers instead, with no file (`lit_rl.rollout.server.collective_transfer`).

Asynchronous rollouts (`model.rollout.max_staleness > 0`, `lit_rl.rollout.asynchronous`): the weights of each policy
version are staged into their own subdirectory `v<version>/` (with a broadcast transfer: as host copies on rank 0, one
per version not yet loaded), and rank 0 runs the submitted generations one after the other on a worker thread, each
first loading the version it was tagged with (so a completion never spans two versions), while the training thread
goes on; the completions are scattered back when the trainer collects them. With in-flight weight updates
(`model.rollout.in_flight_updates`, episodes only) the submitted episodes run side by side instead, and the servers
take each newly staged version between turns (`lit_rl.rollout.in_flight`).

Several servers (`model.rollout.engine.server_urls`, `lit_rl.rollout.server.pool`): each generation's requests are
dealt out across them after a health check, and every push reaches all of them; a server that fails either stops the
run or is taken out of service (`model.rollout.engine.on_server_failure`).

Every request has a timeout; failures to connect, timeouts and 5xx answers are retried with exponential
backoff, then stop the run with one line naming the URL. 4xx answers fail at once with the server's message.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import os
import shutil
import socket
import tempfile
import time
import urllib.parse
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import groupby
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch

from lit_rl.errors import LitRLError
from lit_rl.resume import say
from lit_rl.rollout.base import Generate, RolloutOutput, SamplingParams, draw_seeds, padded_output, unpadded_prompts
from lit_rl.rollout.engine_config import VLLMServer
from lit_rl.rollout.in_flight import InFlightWeights
from lit_rl.rollout.server.client import RolloutServerError, ServerDownError
from lit_rl.rollout.server.collective_transfer import CollectiveTransfer, host_copies
from lit_rl.rollout.server.launch import ServerLauncher
from lit_rl.rollout.server.pool import RolloutServer, ServerPool
from lit_rl.rollout.server.weight_receiver import private_directory
from lit_rl.training.perf import BusyClock

CUT_SHORT = {"abort", "error"}  # finish reasons of a completion the engine stopped before it ended

WEIGHT_SHARD = "model-{:05d}.safetensors"
# Said on rank 0 when the ranks cannot each send their own episodes' turns (`_every_rank_may_sample_alone`).
ONE_SENDER = "each process's episode turns go through rank 0, turn by turn"
# With in-flight weight updates, the most jobs (generations of episodes) running at once: the schedule launches at
# most k // m + 1 ahead of the one being trained on (`lit_rl.rollout.asynchronous`); more wait their turn.
IN_FLIGHT_JOBS = 8


# The sampling options lit-rl has none of, at the values that leave the distribution alone.
NEUTRAL_SAMPLING = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_p": 0.0}


# `<shm>/lit-rl-weights-<pid>-<random>`: the weights' folder of the trainer process `pid`.
WEIGHT_DIR_PREFIX = "lit-rl-weights-"


# A weights' folder untouched this long, of a process that is gone, is stale (a run's pushes rewrite it every step).
STALE_WEIGHTS_S = 3600


def remove_stale_weight_dirs(root: Path, now: Optional[float] = None) -> list[Path]:
    """Remove the weights' folders under `root` of this user's trainer processes that are gone: a killed trainer
    (SIGKILL, out of memory) never runs its clean-up, and a folder in /dev/shm holds a copy of the model in RAM until
    the machine restarts. A folder whose process still runs, or that changed in the last `STALE_WEIGHTS_S` (a run
    in another PID namespace sharing /dev/shm: its process is not seen here), another user's, or one named
    otherwise stays."""
    now = time.time() if now is None else now
    removed = []
    for folder in root.glob(f"{WEIGHT_DIR_PREFIX}*-*"):
        pid = folder.name[len(WEIGHT_DIR_PREFIX) :].split("-", 1)[0]
        try:
            stat = folder.lstat()
            if not pid.isdigit() or folder.is_symlink() or stat.st_uid != os.getuid():
                continue
            if now - stat.st_mtime < STALE_WEIGHTS_S or _running(int(pid)):
                continue
        except OSError:
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def _running(pid: int) -> bool:
    """Whether process `pid` exists (signal 0 checks without sending; a process of another user exists too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class VLLMServerEngine:
    """Generates on vLLM servers and pushes weights to them; see the module docstring for the protocol."""

    needs_weights = True

    def __init__(
        self,
        config: VLLMServer,
        eos_token_ids: Sequence[int],
        pad_token_id: int,
        launcher: Optional[ServerLauncher] = None,
        busy: Optional[BusyClock] = None,
    ) -> None:
        self.config = config
        self.busy = busy or BusyClock()  # counts the time a completions request is outstanding (`perf/engine_busy_s`)
        self.launcher = launcher  # `model.rollout.engine.launch`: rank 0 starts the server
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.rank, self.world_size = _rank_and_world()
        self.pool = ServerPool(config, first_server=self.rank)  # each rank's requests start round the servers apart
        self.transfer = CollectiveTransfer(config) if config.broadcasts_weights and self.rank == 0 else None
        self._staged: dict[int, list[tuple[str, torch.Tensor]]] = {}  # version -> host copies (broadcast, async)
        self._worker: Optional[ThreadPoolExecutor] = None  # rank 0's background generations (asynchronous mode)
        self._closed = False  # a job still running after `close` samples no more turns
        self.in_flight: Optional[InFlightWeights] = None  # in-flight weight updates, once asked for (rank 0)
        self._own_sync_dir = False
        self.sync_dir: Optional[str] = None
        # Rank 0 alone connects; every rank learns whether it worked, so none waits on a dead one, and what it found.
        self._follow(_on_rank0_then_scatter(lambda: self._connect() or self._servers_for_every_rank(), *self._ranks))
        # Whether `concurrent_generate` may run on every rank at once, each rank sending its own rows (multi-turn
        # episodes then go on on their own on every rank, with no collective per turn: `lit_rl.rollout.multi_turn`).
        self.concurrent_on_every_rank = self._every_rank_may_sample_alone()

    def _connect(self) -> None:
        if self.transfer is None and self.config.transfer.sync_dir is not None:
            # A configured folder gets the receiver's checks (the server loads what is in it, so no one else may
            # write there, and it is no link to elsewhere), before a server is started for minutes.
            private_directory(Path(self.config.transfer.sync_dir), "model.rollout.engine.transfer.sync_dir")
        if self.launcher is not None:
            self.launcher.start()
            moved_from = self.pool.servers[0].url
            self.pool.move(self.pool.servers[0], self.launcher.url)  # the port it bound; other ranks `_follow`
            if self.transfer is not None:  # a broadcast's ports are given by the server's place in the list
                self.transfer.order[self.launcher.url] = self.transfer.order.pop(moved_from)
        try:
            self.pool.connect(self.config.wait_for_server_s)
            if self.transfer is not None:  # each server's group now: one that cannot receive fails before training
                self.pool.on_each(self.transfer.connect)
                return
        except BaseException:
            if self.launcher is not None:
                self.launcher.stop()
            raise
        self.sync_dir = self.config.transfer.sync_dir
        if self.sync_dir is None:  # a folder of this process's own, 0700
            shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
            remove_stale_weight_dirs(Path(shm or tempfile.gettempdir()))
            self.sync_dir = tempfile.mkdtemp(prefix=f"{WEIGHT_DIR_PREFIX}{os.getpid()}-", dir=shm)
            self._own_sync_dir = True
            # Removed even when the run dies with an exception (Lightning then skips teardown): /dev/shm is RAM.
            self._cleanup = weakref.finalize(self, shutil.rmtree, self.sync_dir, True)

    # -- generation ------------------------------------------------------------------------------------------
    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        params: SamplingParams,
        seeds: Optional[Sequence[int]] = None,
    ) -> RolloutOutput:
        seeds = draw_seeds(len(prompt_ids)) if seeds is None else list(seeds)
        local = (unpadded_prompts(prompt_ids, prompt_mask), seeds)
        gathered = _gather_to_rank0(local, self.rank, self.world_size)
        token_ids, logprobs = _on_rank0_then_scatter(
            lambda: self._generate_all(gathered, params), self.rank, self.world_size
        )
        return padded_output(token_ids, logprobs, self.eos_token_ids, self.pad_token_id, prompt_ids.device)

    def _generate_all(
        self, per_rank: list[tuple[list[list[int]], list[int]]], params: SamplingParams, check_health: bool = True
    ) -> list[tuple[list[list[int]], list[list[float]]]]:
        """Every rank's completions, in rank order. Runs of identical prompts (the G completions of one prompt) go
        out as one request for n completions, dealt out across the servers in service (`ServerPool.deal`)."""
        requests = []  # (rank, prompt, seed, n)
        for rank, (prompts, seeds) in enumerate(per_rank):
            start = 0
            for _, run in groupby(range(len(prompts)), key=lambda i: tuple(prompts[i])):
                n = len(list(run))
                requests.append((rank, prompts[start], seeds[start], n))
                start += n
        if check_health:
            self.pool.check_health()
        answers = self.pool.deal(
            requests, lambda server, request: self._complete(server, request[1], request[2], request[3], params)
        )
        results: list[tuple[list[list[int]], list[list[float]]]] = [([], []) for _ in per_rank]
        for (rank, *_), (ids, lps) in zip(requests, answers):
            results[rank][0].extend(ids)
            results[rank][1].extend(lps)
        return results

    def _complete(
        self, server: RolloutServer, prompt: list[int], seed: int, n: int, params: SamplingParams
    ) -> tuple[list[list[int]], list[list[float]]]:
        """`n` completions of `prompt`. Greedy ones are one completion, copied: vLLM refuses `n > 1` with greedy
        sampling, which validation asks for when its batch is padded with copies of a prompt (or G > 1)."""
        if params.greedy and n > 1:
            ids, logprobs = self._complete(server, prompt, seed, 1, params)
            return ids * n, logprobs * n
        body = {
            "model": server.model_name,
            "prompt": prompt,
            "n": n,
            "seed": seed,
            "max_tokens": params.max_new_tokens,
            "min_tokens": params.min_new_tokens,
            "temperature": 0.0 if params.greedy else params.temperature,
            "top_p": 1.0 if params.greedy else params.top_p,
            "top_k": 0 if params.greedy else params.top_k,
            # Neutral, said explicitly: a server started by hand fills what a request leaves out from the model's
            # generation_config.json (Qwen2.5-Instruct: repetition_penalty 1.05), which the trainer never applies.
            **NEUTRAL_SAMPLING,
            "logprobs": 0,
            "return_token_ids": True,
            "stop_token_ids": self.eos_token_ids,
            "skip_special_tokens": False,
        }
        with self.busy.request():
            answer = server.client.request("POST", "/v1/completions", body)
        try:
            choices = sorted(answer["choices"], key=lambda choice: choice["index"])
        except (KeyError, TypeError):
            raise RolloutServerError(f"vLLM server {server.url}: the completions answer has no choices") from None
        if len(choices) != n:
            raise RolloutServerError(f"vLLM server {server.url}: asked for {n} completions, got {len(choices)}")
        cut_short = sorted({str(choice.get("finish_reason")) for choice in choices} & CUT_SHORT)
        if cut_short:
            # vLLM answers 200 with the tokens so far when it aborts a request (SIGTERM, `/pause?mode=abort`):
            # training on them would be training on truncated completions. The server is going away: treat it so.
            raise ServerDownError(
                f"vLLM server {server.url}: completions ended with finish_reason {cut_short[0]!r}, cut short; is the "
                "server running? (vLLM aborts its requests when it shuts down, or is paused with mode=abort)"
            )
        try:
            return (
                [list(choice["token_ids"]) for choice in choices],
                [list(choice["logprobs"]["token_logprobs"]) for choice in choices],
            )
        except (KeyError, TypeError):
            raise RolloutServerError(
                f"vLLM server {server.url}: completions come without token_ids or log-probs "
                "(vLLM >= 0.32 with return_token_ids support is needed)"
            ) from None

    # -- weights ---------------------------------------------------------------------------------------------
    def update_weights(self, named_tensors: Optional[Iterable[tuple[str, torch.Tensor]]] = None) -> None:
        """Rank 0 writes the weights to `transfer.sync_dir` and has every server reload them; the others wait for it.

        Every rank consumes its `named_tensors` (a lazy stream gathers ZeRO-3 parameters as a collective)."""
        if self.rank == 0 and named_tensors is None:
            raise ValueError("VLLMServerEngine.update_weights needs the policy's (name, tensor) pairs")
        if self.rank != 0:
            for _ in named_tensors or ():  # take part in the gathers that rank 0's stream goes through
                pass
        pushed = _on_rank0_then_scatter(
            lambda: self._push(iter(named_tensors)) or self._servers_for_every_rank(), *self._ranks
        )
        self._follow(pushed)

    @property
    def _ranks(self) -> tuple[int, int]:
        return self.rank, self.world_size

    def _servers_for_every_rank(self) -> list[list[tuple[str, Optional[str], bool]]]:
        """Rank 0's view of its servers (URL, model name, in service), one copy per rank (`_follow`)."""
        view = [(server.url, server.model_name, server.in_service) for server in self.pool.servers]
        return [view] * self.world_size

    def _follow(self, servers: list[tuple[str, Optional[str], bool]]) -> None:
        """Every other rank takes rank 0's view of the servers: their URLs (a launched server's port is rank 0's),
        the model names it learned, and which are in service, holding the weights just pushed (a server rank 0 took
        out missed them: no rank may sample there)."""
        if self.rank == 0:
            return
        for server, (url, model_name, in_service) in zip(self.pool.servers, servers):
            self.pool.move(server, url)
            server.model_name, server.in_service = model_name, in_service

    def _every_rank_may_sample_alone(self) -> bool:
        """Whether every rank may send its own requests (`concurrent_on_every_rank`); a collective. Not when a
        server rank 0 took out could come back to other ranks before they learn of it (several servers with
        `on_server_failure: continue`: it would serve them its old weights until the next push), nor when some rank
        cannot reach a server (a loopback address on another machine, a firewall): each rank checks every server's
        health once, and all must pass. Otherwise rank 0 sends every rank's requests, as for a generation, and
        says why."""
        if self.world_size == 1:
            return True
        if len(self.pool.servers) > 1 and self.config.on_server_failure == "continue":
            say(f"{ONE_SENDER}: several servers with on_server_failure continue")
            return False
        try:
            for server in self.pool.in_service():
                server.client.check_health(self.pool.health_timeout_s)
            healthy = True
        except Exception:  # whatever it is, every rank must reach the gather below
            healthy = False
        # One gather: each rank's machine and whether it reached every server.
        seen: list[Optional[tuple[str, bool]]] = [None] * self.world_size
        torch.distributed.all_gather_object(seen, (socket.gethostname(), healthy))
        across_machines = len({host for host, _ in seen}) > 1
        if across_machines and any(_is_loopback(server.url) for server in self.pool.servers):
            say(f"{ONE_SENDER}: a loopback server across machines")  # another machine's loopback is not rank 0's
            return False
        if not all(reached for _, reached in seen):
            say(f"{ONE_SENDER}: a rank cannot reach a server")
            return False
        return True

    def _push(self, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        if self.transfer is not None:
            self._broadcast(named_tensors)
            self._weights_replaced()
            return
        self._write(named_tensors, self.sync_dir)
        self.pool.upload(self.sync_dir, "current")  # uploaded, checked and committed before a server is touched

        def reload(server: RolloutServer) -> None:
            self._load_into(server, self.sync_dir, "current")
            server.loaded = None

        self.pool.on_each(reload)
        self.pool.readmit(self.pool.recover(), reload)
        self._weights_replaced()

    def _weights_replaced(self) -> None:
        if self.in_flight is not None:
            self.in_flight.weights_replaced()

    def _broadcast(
        self,
        named_tensors: Iterator[tuple[str, torch.Tensor]],
        servers: Optional[Sequence[RolloutServer]] = None,
        version: Optional[int] = None,
    ) -> None:
        """`transfer.method: gloo | nccl`: to `servers` (default: those in service) and any that answer again, at
        once; a server that failed is taken out (or stops the run), one that came back and took the weights is
        readmitted. Those that took them hold `version` (None: a plain push)."""
        try:
            recovered = self.pool.recover()
            for server in recovered:
                self.transfer.forget(server)  # restarted: its workers join a new group
            targets = [*(self.pool.in_service() if servers is None else servers), *recovered]
            # A version (asynchronous rollouts) is staged as host copies already: not copied again.
            failed = self.transfer.push(targets, named_tensors, owned=version is not None)
        finally:
            for _ in named_tensors:  # after a failure, the other ranks still gather through the rest of the stream
                pass
        for server in targets:
            if server not in failed:
                server.loaded = version
        for server, err in failed.items():
            if server.in_service:
                self.pool.take_out(server, err)
        self.pool.readmit([server for server in recovered if server not in failed], lambda server: None)

    def _load_into(self, server: RolloutServer, directory: str, tag: str) -> None:
        """Have `server` reload the weights written to `directory` as `tag`: from there, or from its receiver's copy
        (uploaded now if it has none yet)."""
        target = directory if server.receiver is None else self.pool.receiver_copy(server.receiver, directory, tag)
        self._reload(server, target)

    def _write(self, named_tensors: Iterator[tuple[str, torch.Tensor]], directory: str) -> None:
        try:
            os.makedirs(directory, exist_ok=True)
            _write_safetensors_shards(named_tensors, directory, int(self.config.push_bucket_mib * 2**20))
        except OSError as err:
            raise RolloutServerError(
                f"cannot write the policy's weights to {directory} ({err.strerror or err}); "
                "set model.rollout.engine.transfer.sync_dir to a directory with room for them, shared with the server"
            ) from None
        finally:
            for _ in named_tensors:  # after a failure, the other ranks still gather through the rest of the stream
                pass

    @staticmethod
    def _reload(server: RolloutServer, directory: str) -> None:
        # `mode=wait` lets any request still running finish; then nothing samples with half-loaded weights.
        client = server.client
        client.request("POST", "/pause?mode=wait")
        try:
            rpc = {"method": "reload_weights", "kwargs": {"weights_path": directory}}
            client.request("POST", "/collective_rpc", rpc, retries=0)  # a failed reload is not retried blindly
            client.reset_prefix_cache()
        finally:
            client.request("POST", "/resume")

    # -- asynchronous rollouts (lit_rl.rollout.asynchronous.AsyncRolloutEngine) -------------------------------------
    def _version_dir(self, version: int) -> str:
        return os.path.join(self.sync_dir, f"v{version}")

    def stage_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Write the weights of `version` into their own directory for the generations tagged with it (with a
        broadcast transfer: keep host copies of them); the servers load them when the first of those starts (see the
        module docstring). A collective, like `update_weights`."""
        if self.rank != 0:
            for _ in named_tensors:
                pass
        if self.config.broadcasts_weights:  # nothing to send yet: the worker thread broadcasts them when needed

            def stage() -> None:
                stream = iter(named_tensors)
                try:
                    self._staged[version] = host_copies(stream)
                finally:  # after a failure, the other ranks still gather through the rest of the stream
                    for _ in stream:
                        pass
                self._offer_in_flight(version)

            _on_rank0_then_share(stage, self.rank, self.world_size)
            return

        def write_and_send() -> None:
            self._write(iter(named_tensors), self._version_dir(version))
            self.pool.upload(self._version_dir(version), f"v{version}")
            self._offer_in_flight(version)

        _on_rank0_then_share(write_and_send, self.rank, self.world_size)

    def _offer_in_flight(self, version: int) -> None:
        if self.in_flight is not None:  # the episodes running take it between their turns
            self.in_flight.staged(version)

    def take_weights_in_flight(self) -> None:
        """In-flight weight updates (`lit_rl.rollout.in_flight`) from now on: submitted jobs run side by side, and
        their turns take each version staged from now on as soon as the turns under way have ended. Asked for
        before the first job is submitted; later calls change nothing."""
        if self.in_flight is None and self.rank == 0:
            self.in_flight = InFlightWeights(self._load_version)

    def submit(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        params: SamplingParams,
        seeds: Sequence[int],
        version: int,
    ) -> tuple[Any, torch.device]:
        """Gather every rank's prompts to rank 0, which queues them on its worker thread; returns the ticket."""
        local = (unpadded_prompts(prompt_ids, prompt_mask), list(seeds))
        gathered = _gather_to_rank0(local, self.rank, self.world_size)
        future = None
        if self.rank == 0:
            future = self._background().submit(self._generate_with_version, gathered, params, version)
        return future, prompt_ids.device

    def collect(self, ticket: tuple[Any, torch.device]) -> RolloutOutput:
        """Wait for a submitted generation and hand each rank its completions (or every rank the error)."""
        future, device = ticket
        token_ids, logprobs = _on_rank0_then_scatter(lambda: future.result(), self.rank, self.world_size)
        return padded_output(token_ids, logprobs, self.eos_token_ids, self.pad_token_id, device)

    def submit_job(
        self, payload: Any, job: Callable[[list[Any]], Callable[[Generate], list[Any]]], version: int
    ) -> Any:
        """Work that samples in turns, such as episodes (`lit_rl.rollout.async_episodes`): every rank's `payload` is
        gathered to rank 0, where `job(payloads)` runs at once, on this thread (it may use the tokenizer), and
        returns the work for the worker thread: `work(generate)`, one result per rank, where
        `generate(prompt_ids, prompt_mask, params, seeds)` samples with the weights of `version` and talks to the
        servers directly (no collective). A collective; returns the ticket for `collect_job`."""
        gathered = _gather_to_rank0(payload, self.rank, self.world_size)
        if self.rank != 0:
            return None
        try:
            work = job(gathered)
        except Exception as err:  # reaches every rank through collect_job, so that none waits on rank 0
            failed: Future = Future()
            failed.set_exception(err)
            return failed
        if self.in_flight is not None:  # its turns take the newest staged version, v(g) or later
            return self._background().submit(work, functools.partial(self.in_flight.sample, self.concurrent_generate))
        return self._background().submit(self._run_with_version, work, version)

    def collect_job(self, ticket: Any) -> Any:
        """Wait for a submitted job and hand each rank its result (or every rank its error). A collective."""
        return _on_rank0_then_scatter(lambda: ticket.result(), self.rank, self.world_size)

    def _background(self) -> ThreadPoolExecutor:
        """Rank 0's worker thread: submitted generations and jobs run on it one after the other (with in-flight
        weight updates, side by side, on as many threads)."""
        if self._worker is None:
            workers = IN_FLIGHT_JOBS if self.in_flight is not None else 1
            self._worker = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lit-rl-rollout")
        return self._worker

    def _run_with_version(self, work: Callable[[Generate], list[Any]], version: int) -> list[Any]:
        self._load_version(version)
        return work(self.concurrent_generate)

    def concurrent_generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        params: SamplingParams,
        seeds: Optional[Sequence[int]] = None,
    ) -> RolloutOutput:
        """This process's rows, straight to the servers: no collective, no health check first, safe to call from
        many threads at once. What a job's work samples with (`submit_job`), and what independent episodes submit
        their turns to (`lit_rl.rollout.multi_turn.run_episodes`), on every rank when `concurrent_on_every_rank`."""
        self._refuse_when_closed()  # the run ended: an abandoned job's episodes end at their next turn
        seeds = draw_seeds(len(prompt_ids)) if seeds is None else list(seeds)
        requests = [(unpadded_prompts(prompt_ids, prompt_mask), seeds)]
        ((token_ids, logprobs),) = self._generate_all(requests, params, check_health=False)
        return padded_output(token_ids, logprobs, self.eos_token_ids, self.pad_token_id, prompt_ids.device)

    def _generate_with_version(
        self, per_rank: list[tuple[list[list[int]], list[int]]], params: SamplingParams, version: int
    ) -> list[tuple[list[list[int]], list[list[float]]]]:
        self._load_version(version)
        return self._generate_all(per_rank, params)

    def _load_version(self, version: int) -> None:
        """Have every server in service hold the staged weights of `version` (on the worker thread); none after
        `close`: a job abandoned by a failed run pushes nothing into a server it no longer owns."""
        self._refuse_when_closed()
        tag = f"v{version}"

        def load(server: RolloutServer) -> None:
            self._load_into(server, self._version_dir(version), tag)
            server.loaded = version

        stale = [server for server in self.pool.in_service() if server.loaded != version]
        if stale and self.transfer is not None:
            self._broadcast(iter(self._staged[version]), stale, version)
            for old in [v for v in list(self._staged) if v < version]:  # never asked for again (versions only grow)
                self._staged.pop(old, None)
        elif stale:
            self.pool.on_each(load, stale)
            self.pool.readmit(self.pool.recover(), load)  # here, on the only thread that deals requests
            for name in os.listdir(self.sync_dir):  # older versions are never asked for again (versions only grow)
                if name.startswith("v") and name[1:].isdigit() and int(name[1:]) < version:
                    shutil.rmtree(os.path.join(self.sync_dir, name), ignore_errors=True)
            # list(): one atomic copy, while the training thread may be recording the next version's upload
            older = {t for _, t in list(self.pool.copies) if t[1:].isdigit()}
            for old in sorted(t for t in older if int(t[1:]) < version):
                self.pool.forget(old)  # the receivers' copies of versions no generation asks for again

    def _refuse_when_closed(self) -> None:
        if self._closed:
            raise RolloutServerError("the vLLM server engine is closed: the run has ended")

    def close(self) -> None:
        self._closed = True
        if self.in_flight is not None:  # jobs still running (abandoned) must not load into a closing engine
            self.in_flight.close()
        self._staged.clear()
        if self._worker is not None:
            self._worker.shutdown(wait=False, cancel_futures=True)
            self._worker = None
        if self._own_sync_dir and self.sync_dir:
            self._cleanup()
            self.sync_dir = None
        if self.launcher is not None:
            self.launcher.stop()


def _write_safetensors_shards(
    named_tensors: Iterable[tuple[str, torch.Tensor]], directory: str, shard_bytes: int
) -> None:
    """Write the weights as `model-00000.safetensors`, `model-00001...`, each of about `shard_bytes` (a shard is
    written as soon as it is full, so only one shard's host copies are held at a time). Files of an earlier push are
    removed first; each file is written to a temporary name, then renamed (a reader never sees half a file)."""
    for name in os.listdir(directory):
        if name.startswith(("model-", ".model-")) and name.endswith((".safetensors", ".tmp")):
            os.remove(os.path.join(directory, name))
    shard: dict[str, torch.Tensor] = {}
    size, index = 0, 0
    for name, tensor in named_tensors:
        # A host copy: the stream's gathered bucket is released as it moves on, whatever the shard holds.
        shard[name] = tensor.detach().to("cpu", copy=True)
        size += tensor.numel() * tensor.element_size()
        if size >= shard_bytes:
            _write_safetensors(shard, os.path.join(directory, WEIGHT_SHARD.format(index)))
            shard, size, index = {}, 0, index + 1
    if shard or index == 0:
        _write_safetensors(shard, os.path.join(directory, WEIGHT_SHARD.format(index)))


def _write_safetensors(named_tensors: dict[str, torch.Tensor], path: str) -> None:
    """Write one file atomically: to a temporary name, then rename."""
    from safetensors.torch import save_file

    tensors = {name: tensor.detach().to("cpu").contiguous() for name, tensor in named_tensors.items()}
    # An unpredictable name, created by this process alone (0600), not *.safetensors: the loader never picks it up.
    handle, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=os.path.dirname(path))
    os.close(handle)
    try:
        save_file(tensors, tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _is_loopback(url: str) -> bool:
    """Whether `url`'s host is this machine's own (a loopback or unspecified address, as written or as its name
    resolves: `localhost`, Debian's 127.0.1.1 host name, `::ffff:127.0.0.1`): the same URL on another machine is
    another server."""
    host = urllib.parse.urlsplit(url).hostname or ""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except (OSError, UnicodeError):  # not resolvable here: the health check says whether it is reachable
        addresses = {host}
    for address in addresses:
        try:
            ip = ipaddress.ip_address(address.split("%")[0])
        except ValueError:
            continue
        for form in (ip, getattr(ip, "ipv4_mapped", None)):
            if form is not None and (form.is_loopback or form.is_unspecified):
                return True
    return host == "localhost"


def _rank_and_world() -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather_to_rank0(obj: Any, rank: int, world_size: int) -> Optional[list[Any]]:
    if world_size == 1:
        return [obj]
    gathered = [None] * world_size if rank == 0 else None
    torch.distributed.gather_object(obj, gathered, dst=0)
    return gathered


def _on_rank0_then_share(fn: Callable[[], None], rank: int, world_size: int) -> None:
    """Run `fn` on rank 0; if it fails with a server error, every rank raises it (none is left waiting)."""
    _on_rank0_then_scatter(lambda: [fn()] * world_size, rank, world_size)


def _on_rank0_then_scatter(fn: Callable[[], list[Any]], rank: int, world_size: int) -> Any:
    """Run `fn` (one result per rank) on rank 0 and hand each rank its result, or its `RolloutServerError`."""
    outcome: list[Any] = []
    if rank == 0:
        try:
            outcome = [("ok", result) for result in fn()]
        except Exception as err:  # any failure on rank 0 must reach the ranks waiting for its answer
            # lit-rl's one-line errors (a server's, a refused sync_dir) as they are; anything else as the server's
            message = str(err) if isinstance(err, LitRLError) else f"vLLM server: {type(err).__name__}: {err}"
            outcome = [("error", message)] * world_size
    if world_size > 1:
        received = [None]
        torch.distributed.scatter_object_list(received, outcome if rank == 0 else None, src=0)
        status, value = received[0]
    else:
        status, value = outcome[0]
    if status == "error":
        raise RolloutServerError(value)
    return value
