"""Rollouts from a separately started vLLM server, over HTTP. Imports no vLLM: the trainer needs none installed.

Start the server (same machine or one that shares `weight_sync_dir`), bound to 127.0.0.1 unless it must be
reached from elsewhere:

    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model <policy> --served-model-name policy \
        --host 127.0.0.1 --port 8000 --logprobs-mode processed_logprobs --generation-config vllm

`VLLM_SERVER_DEV_MODE=1` enables vLLM's RL endpoints (`/pause`, `/resume`, `/collective_rpc`, ...).

Only rank 0 talks to the server: every rank's prompts (and per-completion seeds) are gathered to it, it sends one
request per run of identical prompts (`n` completions; vLLM gives child `i` the seed `seed + i`), and the
completions are scattered back. A weight push writes the policy's weights as safetensors into `weight_sync_dir`,
one file per `push_bucket_mib` (rank 0 never holds more than about one bucket of gathered weights; the other ranks
take part in the gathers), then asks the server to pause, reload from there (`collective_rpc("reload_weights")`),
reset its prefix cache and resume. On GPUs an NCCL transfer would skip the file; this path works on CPU too.

Asynchronous rollouts (`model.max_staleness > 0`, `lit_rl.rollout.producer`): the weights of each policy version
are staged into their own subdirectory `v<version>/`, and rank 0 runs the submitted generations one after the
other on a worker thread, each first reloading the version it was tagged with (so a completion never spans two
versions), while the training thread goes on; the completions are scattered back when the trainer collects them.

Every request has a timeout; failures to connect, timeouts and 5xx answers are retried with exponential
backoff, then stop the run with one line naming the URL. 4xx answers fail at once with the server's message.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from concurrent.futures import ThreadPoolExecutor
from itertools import groupby
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch

from lit_rl.errors import LitRLError
from lit_rl.rollout.base import RolloutOutput, SamplingParams, draw_seeds, padded_output, unpadded_prompts
from lit_rl.rollout.config import VLLMConfig
from lit_rl.rollout.weight_receiver import WeightTransferError, WeightUploader

WEIGHT_SHARD = "model-{:05d}.safetensors"


def server_command(model: str, port: int, host: str = "127.0.0.1", cpu: bool = True) -> tuple[list[str], dict]:
    """The documented command that starts a vLLM server lit-rl can drive: (argv, extra environment).

    `--logprobs-mode processed_logprobs` reports the log-probs of the distribution sampled from (what the
    trainer recomputes); `--generation-config vllm` ignores the repository's sampling defaults.
    """
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--served-model-name",
        "policy",
        "--host",
        host,
        "--port",
        str(port),
        "--logprobs-mode",
        "processed_logprobs",
        "--generation-config",
        "vllm",
    ]
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    if cpu:
        argv += ["--dtype", "float32", "--enforce-eager"]
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    return argv, env


class LocalVLLMServer:
    """`server_command` started as a child process on 127.0.0.1 (a free port unless `port` is given), waited for
    until healthy; `stop()` ends it.

    For tests, benchmarks and single-machine runs; a production server is started by its own supervisor.
    """

    def __init__(
        self,
        model: str,
        log_path: str,
        port: Optional[int] = None,
        cpu: bool = True,
        extra_args: Sequence[str] = (),
        timeout_s: float = 600,
    ) -> None:
        import subprocess

        port = port or free_port()
        argv, env = server_command(model, port, cpu=cpu)
        self.url = f"http://127.0.0.1:{port}"
        self._log = open(log_path, "w")
        try:
            self.process = subprocess.Popen(
                [*argv, *extra_args], env={**os.environ, **env}, stdout=self._log, stderr=subprocess.STDOUT
            )
        except BaseException:
            self._log.close()
            raise
        try:
            client = VLLMServerClient(self.url, timeout_s=2.0, max_retries=0)
            client.wait_until_healthy(timeout_s, gone=lambda: self.process.poll() is not None)
        except RolloutServerError:
            self.stop()
            raise RolloutServerError(f"vLLM server {self.url} did not start; its log: {log_path}") from None
        except BaseException:  # never leave a server running behind Ctrl-C
            self.stop()
            raise

    def stop(self) -> None:
        import subprocess

        if self._log.closed:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self._log.close()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RolloutServerError(LitRLError):
    """The vLLM server could not be reached or answered with an error."""


class _RetryableError(Exception):
    pass


class VLLMServerClient:
    """JSON over HTTP to one vLLM server, with a timeout on every request and retries with backoff."""

    def __init__(self, base_url: str, timeout_s: float, max_retries: int) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.max_retries = max_retries

    def request(self, method: str, path: str, body: Optional[dict] = None, retries: Optional[int] = None) -> Any:
        """Send one request, retrying connection failures, timeouts and 5xx answers; the parsed JSON answer."""
        url = f"{self.base_url}{path}"
        retries = self.max_retries if retries is None else retries
        for attempt in range(retries + 1):
            try:
                return self._once(method, url, body)
            except _RetryableError as err:
                if attempt == retries:
                    raise RolloutServerError(
                        f"vLLM server {url}: {err} (after {attempt + 1} attempts, timeout {self.timeout_s:g} s "
                        "each); is the server running? (see model.vllm.server_url)"
                    ) from None
                time.sleep(min(2.0**attempt, 30.0))

    def _once(self, method: str, url: str, body: Optional[dict], timeout_s: Optional[float] = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=min(timeout_s or self.timeout_s, self.timeout_s)) as response:
                payload = response.read()
        except urllib.error.HTTPError as err:
            message = _error_message(err)
            if err.code >= 500:
                raise _RetryableError(f"HTTP {err.code}: {message}") from None
            raise RolloutServerError(f"vLLM server {url}: HTTP {err.code}: {message}") from None
        except (urllib.error.URLError, http.client.HTTPException, TimeoutError, ConnectionError, OSError) as err:
            reason = getattr(err, "reason", err)
            raise _RetryableError(f"no answer ({type(err).__name__}: {reason})") from None
        try:
            return json.loads(payload) if payload else None
        except ValueError:
            raise RolloutServerError(f"vLLM server {url}: the answer is not JSON: {payload[:200]!r}") from None

    def wait_until_healthy(self, wait_s: float, gone: Callable[[], bool] = lambda: False) -> None:
        """Poll `/health` until the server answers, for at most `wait_s` seconds (it may still be starting), or
        until `gone()` says it never will (its process exited)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self._once("GET", f"{self.base_url}/health", None, timeout_s=max(1.0, deadline - time.monotonic()))
                return
            except (_RetryableError, RolloutServerError) as err:
                if time.monotonic() >= deadline or gone():
                    raise RolloutServerError(
                        f"vLLM server {self.base_url}/health: {err} (waited {wait_s:g} s; "
                        "model.vllm.wait_for_server_s); is the server running? (see model.vllm.server_url)"
                    ) from None
                time.sleep(1.0)


def _error_message(err: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(err.read() or b"{}")
    except (ValueError, OSError):
        return str(err.reason)
    detail = body.get("error", body.get("detail", body)) if isinstance(body, dict) else body
    if isinstance(detail, dict):
        detail = detail.get("message", detail)
    return " ".join(str(detail).split())[:300]


class VLLMServerEngine:
    """Generates on a vLLM server and pushes weights to it; see the module docstring for the protocol."""

    needs_weights = True

    def __init__(self, config: VLLMConfig, eos_token_ids: Sequence[int], pad_token_id: int) -> None:
        self.config = config
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.rank, self.world_size = _rank_and_world()
        self.client = VLLMServerClient(config.server_url, config.request_timeout_s, config.max_retries)
        self.model_name: Optional[str] = None
        self._worker: Optional[ThreadPoolExecutor] = None  # rank 0's background generations (asynchronous mode)
        self._loaded_version: Optional[int] = None  # the staged version the server holds; None after a plain push
        self._own_sync_dir = False
        self.sync_dir: Optional[str] = None
        # On another machine: the weights are uploaded to the receiver beside the server (`weight_receiver`).
        self.uploader = (
            WeightUploader(config.weights_url, config.request_timeout_s, config.max_retries)
            if config.uploads_weights
            else None
        )
        self._server_dirs: dict[int, str] = {}  # staged version -> where the server reads it
        # Rank 0 alone connects; every rank learns whether it worked, so none waits on a dead one.
        _on_rank0_then_share(self._connect, self.rank, self.world_size)

    def _connect(self) -> None:
        self.client.wait_until_healthy(self.config.wait_for_server_s)
        try:
            self.model_name = self.client.request("GET", "/v1/models")["data"][0]["id"]
        except (KeyError, IndexError, TypeError):
            raise RolloutServerError(f"vLLM server {self.client.base_url}/v1/models lists no model") from None
        self.sync_dir = self.config.weight_sync_dir
        if self.sync_dir is None:
            shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
            self.sync_dir = tempfile.mkdtemp(prefix="lit-rl-weights-", dir=shm)
            self._own_sync_dir = True
            # Removed even when the run dies with an exception (Lightning then skips teardown): /dev/shm is RAM.
            self._cleanup = weakref.finalize(self, shutil.rmtree, self.sync_dir, True)
        os.makedirs(self.sync_dir, exist_ok=True)

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
        self, per_rank: list[tuple[list[list[int]], list[int]]], params: SamplingParams
    ) -> list[tuple[list[list[int]], list[list[float]]]]:
        """Every rank's completions, in rank order. Runs of identical prompts (the G completions of one prompt) go
        out as one request for n completions; all requests share one pool, and the first failure cancels the rest."""
        requests = []  # (rank, prompt, seed, n)
        for rank, (prompts, seeds) in enumerate(per_rank):
            start = 0
            for _, run in groupby(range(len(prompts)), key=lambda i: tuple(prompts[i])):
                n = len(list(run))
                requests.append((rank, prompts[start], seeds[start], n))
                start += n
        pool = ThreadPoolExecutor(max_workers=max(1, min(16, len(requests))))
        try:
            futures = [pool.submit(self._complete, prompt, seed, n, params) for _, prompt, seed, n in requests]
            answers = [future.result() for future in futures]
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        results: list[tuple[list[list[int]], list[list[float]]]] = [([], []) for _ in per_rank]
        for (rank, *_), (ids, lps) in zip(requests, answers):
            results[rank][0].extend(ids)
            results[rank][1].extend(lps)
        return results

    def _complete(
        self, prompt: list[int], seed: int, n: int, params: SamplingParams
    ) -> tuple[list[list[int]], list[list[float]]]:
        body = {
            "model": self.model_name,
            "prompt": prompt,
            "n": n,
            "seed": seed,
            "max_tokens": params.max_new_tokens,
            "min_tokens": params.min_new_tokens,
            "temperature": 0.0 if params.greedy else params.temperature,
            "top_p": 1.0 if params.greedy else params.top_p,
            "top_k": 0 if params.greedy else params.top_k,
            "logprobs": 0,
            "return_token_ids": True,
            "stop_token_ids": self.eos_token_ids,
            "skip_special_tokens": False,
        }
        answer = self.client.request("POST", "/v1/completions", body)
        choices = sorted(answer["choices"], key=lambda choice: choice["index"])
        if len(choices) != n:
            raise RolloutServerError(
                f"vLLM server {self.client.base_url}: asked for {n} completions, got {len(choices)}"
            )
        try:
            return (
                [list(choice["token_ids"]) for choice in choices],
                [list(choice["logprobs"]["token_logprobs"]) for choice in choices],
            )
        except (KeyError, TypeError):
            raise RolloutServerError(
                f"vLLM server {self.client.base_url}: completions come without token_ids or log-probs "
                "(vLLM >= 0.32 with return_token_ids support is needed)"
            ) from None

    # -- weights ---------------------------------------------------------------------------------------------
    def update_weights(self, named_tensors: Optional[Iterable[tuple[str, torch.Tensor]]] = None) -> None:
        """Rank 0 writes the weights to `weight_sync_dir` and has the server reload them; the others wait for it.

        Every rank consumes its `named_tensors` (a lazy stream gathers ZeRO-3 parameters as a collective)."""
        if self.rank == 0 and named_tensors is None:
            raise ValueError("VLLMServerEngine.update_weights needs the policy's (name, tensor) pairs")
        if self.rank != 0:
            for _ in named_tensors or ():  # take part in the gathers that rank 0's stream goes through
                pass
        _on_rank0_then_share(lambda: self._push(iter(named_tensors)), self.rank, self.world_size)

    def _push(self, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        self._write(named_tensors, self.sync_dir)
        self._reload(self._server_dir(self.sync_dir, "current"))
        self._loaded_version = None

    def _server_dir(self, directory: str, tag: str) -> str:
        """Where the server reads the weights written to `directory`: that directory, or with a receiver the one it
        stored the upload of version `tag` in (uploaded, checked and committed before the server is touched)."""
        if self.uploader is None:
            return directory
        try:
            return self.uploader.upload(directory, tag)
        except WeightTransferError as err:
            raise RolloutServerError(str(err)) from None

    def _write(self, named_tensors: Iterator[tuple[str, torch.Tensor]], directory: str) -> None:
        try:
            os.makedirs(directory, exist_ok=True)
            _write_safetensors_shards(named_tensors, directory, int(self.config.push_bucket_mib * 2**20))
        except OSError as err:
            raise RolloutServerError(
                f"cannot write the policy's weights to {directory} ({err.strerror or err}); "
                "set model.vllm.weight_sync_dir to a directory with room for them, shared with the server"
            ) from None
        finally:
            for _ in named_tensors:  # after a failure, the other ranks still gather through the rest of the stream
                pass

    def _reload(self, directory: str) -> None:
        # `mode=wait` lets any request still running finish; then nothing samples with half-loaded weights.
        self.client.request("POST", "/pause?mode=wait")
        try:
            rpc = {"method": "reload_weights", "kwargs": {"weights_path": directory}}
            self.client.request("POST", "/collective_rpc", rpc, retries=0)  # a failed reload is not retried blindly
            self.client.request("POST", "/reset_prefix_cache")
        finally:
            self.client.request("POST", "/resume")

    # -- asynchronous rollouts (lit_rl.rollout.producer.AsyncRolloutEngine) -------------------------------------
    def _version_dir(self, version: int) -> str:
        return os.path.join(self.sync_dir, f"v{version}")

    def stage_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Write the weights of `version` into their own directory for the generations tagged with it; the server
        loads them when the first of those starts (see the module docstring). A collective, like `update_weights`."""
        if self.rank != 0:
            for _ in named_tensors:
                pass

        def write_and_send() -> None:
            self._write(iter(named_tensors), self._version_dir(version))
            self._server_dirs[version] = self._server_dir(self._version_dir(version), f"v{version}")

        _on_rank0_then_share(write_and_send, self.rank, self.world_size)

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
            if self._worker is None:
                self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lit-rl-rollout")
            future = self._worker.submit(self._generate_with_version, gathered, params, version)
        return future, prompt_ids.device

    def collect(self, ticket: tuple[Any, torch.device]) -> RolloutOutput:
        """Wait for a submitted generation and hand each rank its completions (or every rank the error)."""
        future, device = ticket
        token_ids, logprobs = _on_rank0_then_scatter(lambda: future.result(), self.rank, self.world_size)
        return padded_output(token_ids, logprobs, self.eos_token_ids, self.pad_token_id, device)

    def _generate_with_version(
        self, per_rank: list[tuple[list[list[int]], list[int]]], params: SamplingParams, version: int
    ) -> list[tuple[list[list[int]], list[list[float]]]]:
        if self._loaded_version != version:
            self._reload(self._server_dirs.get(version, self._version_dir(version)))
            self._loaded_version = version
            for name in os.listdir(self.sync_dir):  # older versions are never asked for again (versions only grow)
                if name.startswith("v") and name[1:].isdigit() and int(name[1:]) < version:
                    shutil.rmtree(os.path.join(self.sync_dir, name), ignore_errors=True)
            for old in [v for v in self._server_dirs if v < version]:
                del self._server_dirs[old]
                if self.uploader is not None:  # the receiver's copy of a version no generation asks for again
                    self.uploader.delete(f"v{old}")
        return self._generate_all(per_rank, params)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=False, cancel_futures=True)
            self._worker = None
        if self._own_sync_dir and self.sync_dir:
            self._cleanup()
            self.sync_dir = None


def _write_safetensors_shards(
    named_tensors: Iterable[tuple[str, torch.Tensor]], directory: str, shard_bytes: int
) -> None:
    """Write the weights as `model-00000.safetensors`, `model-00001...`, each of about `shard_bytes` (a shard is
    written as soon as it is full, so only one shard's host copies are held at a time). Files of an earlier push are
    removed first; each file is written to a temporary name, then renamed (a reader never sees half a file)."""
    for name in os.listdir(directory):
        if name.startswith("model-") and name.endswith((".safetensors", ".safetensors.tmp")):
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
    tmp = f"{path}.tmp"  # not *.safetensors: the server's loader never picks it up
    save_file(tensors, tmp)
    os.replace(tmp, path)


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
            message = str(err) if isinstance(err, RolloutServerError) else f"vLLM server: {type(err).__name__}: {err}"
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
