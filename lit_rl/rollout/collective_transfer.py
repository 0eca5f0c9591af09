"""Weights to vLLM servers by broadcast (`model.vllm.weight_transfer: gloo | nccl`), through vLLM's weight-transfer
endpoints: no file, no shared disk, no copy on the server's disk.

Rank 0 forms a group with each server's workers, as rank 0 of it, hosting the rendezvous at
`transfer_address:port` (`port`: `transfer_port + i` for the i-th server, or a free one). A server's workers join
when asked (`POST /init_weight_transfer_engine`); how many there are is learned from the server first, and a server
started without a weight-transfer engine is refused in one line saying how to start it. `gloo` is lit-rl's engine
(`lit_rl.rollout.vllm_transfer_plugin`, any device), `nccl` vLLM's own (GPUs on both sides); the protocol is the same.

A push, per server, all servers at once:

    POST /pause?mode=wait                 running requests finish; nothing new starts
    POST /start_weight_update             the workers begin a layerwise reload
    per chunk: POST /update_weights       names, dtypes and shapes of the chunk's tensors, while rank 0
               broadcast, one per tensor  broadcasts them; the workers load each as it lands
    POST /finish_weight_update            the layers are finalized
    POST /reset_prefix_cache, /resume

Verify, then resume: a server is resumed only once every chunk and the finish were acknowledged. One that fails
part-way holds half-loaded weights: it is left paused, never serving them, and counts as down (`ServerDownError`:
the run stops, or under `on_server_failure: continue` it is taken out of service); its group is dropped and formed
again if it answers later. A chunk holds at most `push_bucket_mib` of tensors, each copied as it arrives (so a
chunk outlives the weight stream's gather bucket, `lit_rl.rollout.weights`): rank 0 holds about one chunk.
"""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, Callable, Iterable, Iterator, Optional, Protocol, Sequence

import torch

from lit_rl.rollout.config import VLLM_TRANSFER_BACKENDS, VLLMConfig
from lit_rl.rollout.server_client import RolloutServerError, ServerDownError
from lit_rl.rollout.server_pool import RolloutServer


class TransferGroup(Protocol):
    """Rank 0's end of one server's group."""

    def broadcast(self, tensor: torch.Tensor, give_up: Callable[[], bool]) -> None:
        """Send `tensor` to the workers; return early, leaving it unsent, once `give_up()` (they will not take it)."""
        ...

    def synchronize(self) -> None: ...


def tcp_uri(address: str, port: int) -> str:
    return f"tcp://[{address}]:{port}" if ":" in address else f"tcp://{address}:{port}"


class GlooGroup:
    """A gloo group outside torch's global state, formed as vLLM's `stateless_init_torch_distributed_process_group`
    forms the workers' end (the same store keys), with torch alone: the trainer needs no vLLM installed."""

    def __init__(self, address: str, port: int, world_size: int, timeout_s: float) -> None:
        from torch.distributed import PrefixStore, rendezvous
        from torch.distributed.distributed_c10d import ProcessGroupGloo

        uri = tcp_uri(address, port)
        timeout = timedelta(seconds=timeout_s)
        self.store, _, _ = next(rendezvous(uri, 0, world_size, timeout=timeout))  # rank 0 hosts it
        self.store.set_timeout(timeout)
        self.backend = ProcessGroupGloo(PrefixStore(uri, self.store), 0, world_size, timeout=timeout)
        self.backend._set_sequence_number_for_group()  # the workers wait for rank 0's sequence number
        self.options = torch.distributed.BroadcastOptions()
        self.options.rootRank = 0

    def broadcast(self, tensor: torch.Tensor, give_up: Callable[[], bool]) -> None:
        # A send completes only when the workers receive it: polled, so a worker that refused the chunk (its
        # `/update_weights` failed) is not waited for until the group's timeout.
        work = self.backend.broadcast([tensor], self.options)
        while not work.is_completed():
            if give_up():
                return
            time.sleep(0.001)
        work.wait()  # raises the send's error, if it failed

    def synchronize(self) -> None:
        pass  # a gloo broadcast has been sent when it returns


class NcclGroup:
    """vLLM's NCCL communicator as rank 0 (needs vLLM and a GPU beside the trainer)."""

    def __init__(self, address: str, port: int, world_size: int, timeout_s: float) -> None:
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        self.comm = trainer_init({"master_address": address, "master_port": port, "world_size": world_size})

    def broadcast(self, tensor: torch.Tensor, give_up: Callable[[], bool]) -> None:
        self.comm.broadcast(tensor, src=0, stream=torch.cuda.current_stream())  # enqueued on the stream

    def synchronize(self) -> None:
        torch.cuda.current_stream().synchronize()


GROUPS = {"gloo": GlooGroup, "nccl": NcclGroup}


def weight_chunks(
    named_tensors: Iterable[tuple[str, torch.Tensor]], chunk_bytes: int, device: torch.device
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The stream cut into chunks of at most `chunk_bytes` (a larger tensor is a chunk alone), each tensor a
    contiguous copy on `device` made as it arrives."""
    chunk: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        copy = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device=device).copy_(tensor.detach())
        nbytes = copy.numel() * copy.element_size()
        if chunk and size + nbytes > chunk_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append((name, copy))
        size += nbytes
    if chunk:
        yield chunk


def chunk_info(chunk: Sequence[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """What `/update_weights` announces of a chunk (vLLM's NCCL and lit-rl's gloo engine read the same fields)."""
    return {
        "names": [name for name, _ in chunk],
        "dtype_names": [str(tensor.dtype).removeprefix("torch.") for _, tensor in chunk],
        "shapes": [list(tensor.shape) for _, tensor in chunk],
    }


class CollectiveTransfer:
    """Rank 0's side of the broadcast to every server (see the module docstring)."""

    def __init__(self, config: VLLMConfig) -> None:
        self.kind = config.weight_transfer
        self.address = config.transfer_address
        self.first_port = config.transfer_port
        self.timeout_s = config.request_timeout_s
        self.chunk_bytes = int(config.push_bucket_mib * 2**20)
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.kind == "nccl" else torch.device("cpu")
        self.order = {url.rstrip("/"): i for i, (url, _) in enumerate(config.server_endpoints())}
        self.groups: dict[str, TransferGroup] = {}  # server URL -> its group, once formed

    # -- groups ----------------------------------------------------------------------------------------------
    def connect(self, server: RolloutServer) -> None:
        """Form `server`'s group: learn its workers, ask them to join, and host the rendezvous meanwhile."""
        workers = self._count_workers(server)
        port = self.first_port + self.order[server.url] if self.first_port else _free_port(self.address)
        init_info: dict[str, Any] = {
            "master_address": self.address,
            "master_port": port,
            "rank_offset": 1,
            "world_size": 1 + workers,
        }
        if self.kind == "gloo":
            init_info["timeout_s"] = self.timeout_s
        body = {"init_info": init_info}
        joined = _Background(lambda: server.client.request("POST", "/init_weight_transfer_engine", body, retries=0))
        try:
            group = GROUPS[self.kind](self.address, port, 1 + workers, self.timeout_s)
        except Exception as err:  # no worker came: the request's own error says why, if it has one
            joined.wait(timeout=5.0)
            raise ServerDownError(
                f"vLLM server {server.url}: its workers did not join the weight transfer at "
                f"{tcp_uri(self.address, port)} ({joined.error or err}); can the server reach "
                "model.vllm.transfer_address?"
            ) from None
        joined.result(self.timeout_s, server.url)
        self.groups[server.url] = group

    def _count_workers(self, server: RolloutServer) -> int:
        """How many workers `server` has, asking each whether it has a weight-transfer engine (it raises if not)."""
        backend = VLLM_TRANSFER_BACKENDS[self.kind]
        try:
            rpc = {"method": "_check_weight_transfer_engine"}
            answer = server.client.request("POST", "/collective_rpc", rpc, retries=0)
        except ServerDownError:
            server.client.check_health(self.timeout_s)  # down: raises ServerDownError; up: it has no engine
            answer = None
        except RolloutServerError:
            answer = None
        results = answer.get("results") if isinstance(answer, dict) else None
        if not results:
            raise RolloutServerError(
                f"vLLM server {server.url} has no weight-transfer engine: start it with --weight-transfer-config "
                f'\'{{"backend": "{backend}"}}\' (model.vllm.weight_transfer: {self.kind})'
                + ("; lit-rl must be installed beside it, which registers the backend" if self.kind == "gloo" else "")
            )
        return len(results)

    def forget(self, server: RolloutServer) -> None:
        """Drop `server`'s group (it failed): it is formed again before the server next gets weights."""
        self.groups.pop(server.url, None)

    # -- pushes ----------------------------------------------------------------------------------------------
    def push(
        self, servers: Sequence[RolloutServer], named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> dict[RolloutServer, ServerDownError]:
        """Broadcast the weights to every one of `servers` at once, each paused throughout and resumed only once
        it has acknowledged all of them; the servers that failed, each with its error (left paused, groups
        dropped). Consumes the whole stream whatever fails (under ZeRO-3 it is a collective)."""
        failed: dict[RolloutServer, ServerDownError] = {}

        def each(fn, targets: Sequence[RolloutServer]) -> None:
            def run(server: RolloutServer) -> None:
                try:
                    fn(server)
                except (RolloutServerError, RuntimeError, OSError) as err:  # gloo's errors are RuntimeErrors
                    # A server in service that refuses to form its group is set up wrong: stop. One coming back
                    # without its engine just stays out.
                    setup = isinstance(err, RolloutServerError) and not isinstance(err, ServerDownError)
                    if setup and server.in_service and server.url not in self.groups:
                        raise
                    failed[server] = ServerDownError(
                        f"vLLM server {server.url}: the weight transfer failed ({' '.join(str(err).split())[:300]}); "
                        "it is left paused rather than serve half-loaded weights"
                    )
                    self.forget(server)

            with ThreadPoolExecutor(max_workers=max(1, len(targets))) as pool:
                futures = [pool.submit(run, server) for server in targets]
            for future in futures:
                future.result()

        def live() -> list[RolloutServer]:
            return [server for server in servers if server not in failed]

        each(self._begin, servers)
        for chunk in weight_chunks(named_tensors, self.chunk_bytes, self.device):
            each(lambda server: self._send(server, chunk), live())
        each(self._finish, live())
        return failed

    def _begin(self, server: RolloutServer) -> None:
        if server.url not in self.groups:
            self.connect(server)
        server.client.request("POST", "/pause?mode=wait")
        server.client.request("POST", "/start_weight_update", retries=0)

    def _send(self, server: RolloutServer, chunk: Sequence[tuple[str, torch.Tensor]]) -> None:
        group = self.groups[server.url]
        body = {"update_info": chunk_info(chunk)}
        received = _Background(lambda: server.client.request("POST", "/update_weights", body, retries=0))
        refused = lambda: received.error is not None  # noqa: E731  (refused: broadcasting waits for no one)
        try:
            for _, tensor in chunk:
                if refused():
                    break
                group.broadcast(tensor, give_up=refused)
            group.synchronize()
        except RuntimeError:
            if received.wait(timeout=1.0) and received.error is not None:
                raise received.error from None  # the worker's own error says more than the broken send
            raise
        received.result(self.timeout_s, server.url)

    def _finish(self, server: RolloutServer) -> None:
        server.client.request("POST", "/finish_weight_update", {}, retries=0)
        server.client.request("POST", "/reset_prefix_cache")
        server.client.request("POST", "/resume")


class _Background:
    """A request on a daemon thread (never joined at exit: a worker that never answers must not hang the run's
    end), with its error, if any, kept for the caller."""

    def __init__(self, fn) -> None:
        self.error: Optional[BaseException] = None
        self._done = threading.Event()

        def run() -> None:
            try:
                fn()
            except BaseException as err:
                self.error = err
            finally:
                self._done.set()

        threading.Thread(target=run, daemon=True, name="lit-rl-weight-transfer").start()

    def wait(self, timeout: float) -> bool:
        return self._done.wait(timeout)

    def result(self, timeout: float, url: str) -> None:
        if not self._done.wait(timeout):
            raise ServerDownError(f"vLLM server {url}: no answer to the weight transfer within {timeout:g} s")
        if self.error is not None:
            raise self.error


def _free_port(address: str) -> int:
    """A port nothing listens on right now at `address` (this machine's)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family) as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]
