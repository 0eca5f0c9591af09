"""Weights to vLLM servers by broadcast (`model.rollout.engine.transfer.method: gloo | nccl`), through vLLM's
weight-transfer endpoints: no file, no shared disk, no copy on the server's disk.

Rank 0 forms a group with each server's workers, as rank 0 of it, hosting the rendezvous at
`transfer.address:port` (`port`: `transfer.port + i` for the i-th server, or a free one). A server's workers join
when asked (`POST /init_weight_transfer_engine`); how many there are is learned from the server first
(`/get_world_size`), an update an earlier trainer left unfinished is ended, and a server started without a
weight-transfer engine is refused in one line saying how to start it. `gloo` is lit-rl's engine
(`lit_rl.rollout.in_server.vllm_transfer_plugin`, any device), `nccl` vLLM's own (GPUs on both sides); the protocol is
the same.

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

import ctypes
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, Callable, Iterable, Iterator, Optional, Protocol, Sequence

import torch

from lit_rl.errors import one_line
from lit_rl.rollout.engine_config import VLLMServer
from lit_rl.rollout.engines.vllm_config import VLLM_TRANSFER_BACKENDS
from lit_rl.rollout.server.client import RolloutServerError, ServerDownError
from lit_rl.rollout.server.pool import RolloutServer
from lit_rl.training.compat import set_group_sequence_number


class TransferGroup(Protocol):
    """Rank 0's end of one server's group."""

    def broadcast(self, tensor: torch.Tensor, give_up: Callable[[], bool]) -> None:
        """Send `tensor` to the workers and wait until it is sent; return early, leaving it unsent, once `give_up()`
        (they will not take it), or raise `RuntimeError` after the group's timeout."""
        ...

    def joined(self) -> None:
        """Every worker has joined the group: what served the rendezvous can go."""
        ...

    def abandon(self) -> None:
        """The group will not be used again (it failed): release what can be released without waiting."""
        ...


def tcp_uri(address: str, port: int) -> str:
    return f"tcp://[{address}]:{port}" if ":" in address else f"tcp://{address}:{port}"


def _wait_until(done: Callable[[], bool], give_up: Callable[[], bool], timeout_s: float, what: str) -> bool:
    """Poll `done()` until it holds (True), `give_up()` does (False), or `timeout_s` passes (RuntimeError)."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if give_up():
            return False
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not complete within {timeout_s:g} s")
        time.sleep(0.001)
    return True


class _StoreUntilJoined(torch.distributed.Store):
    """The rendezvous store as the group sees it, until the workers have joined: then `release` drops the TCP store,
    whose server stops listening (the group itself never reads the store again). A gloo group keeps its store for
    good, so it is handed this stand-in instead."""

    def __init__(self, store: torch.distributed.Store) -> None:
        super().__init__()
        self.store: Optional[torch.distributed.Store] = store

    def release(self) -> None:
        self.store = None

    def _live(self) -> torch.distributed.Store:
        if self.store is None:
            raise RuntimeError("the weight transfer's rendezvous is closed: the group has formed")
        return self.store

    def set(self, key: str, value: Any) -> None:
        self._live().set(key, value)

    def get(self, key: str) -> bytes:
        return self._live().get(key)

    def add(self, key: str, amount: int) -> int:
        return self._live().add(key, amount)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self._live().compare_set(key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        return self._live().check(keys)

    def wait(self, keys: list[str], timeout: Optional[timedelta] = None) -> None:
        self._live().wait(keys) if timeout is None else self._live().wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        return self._live().delete_key(key)

    def num_keys(self) -> int:
        return self._live().num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self._live().set_timeout(timeout)


class GlooGroup:
    """A gloo group outside torch's global state, formed as vLLM's `stateless_init_torch_distributed_process_group`
    forms the workers' end (the same store keys), with torch alone: the trainer needs no vLLM installed.

    The rendezvous store serves `listener`, a socket bound to `address` alone (as vLLM's own groups bind theirs; a
    store left to bind itself listens on every interface), and closes once the workers have joined (`joined`):
    nothing can connect to it afterwards. (Shutting the socket while the store's server still polls it would make
    that server spin.)"""

    def __init__(self, listener: socket.socket, address: str, world_size: int, timeout_s: float) -> None:
        from torch.distributed import PrefixStore, TCPStore
        from torch.distributed.distributed_c10d import ProcessGroupGloo

        port = listener.getsockname()[1]
        uri = tcp_uri(address, port)  # as the workers name it (an address or a host name): the store's key prefix
        timeout = timedelta(seconds=timeout_s)
        served = os.dup(listener.fileno())  # the store's own; the caller closes `listener`
        try:
            # Rank 0 hosts the store itself (not through `rendezvous`, which under torchrun would only connect to
            # the agent's store); it waits for every worker to connect.
            store = TCPStore(
                address, port, world_size, True, timeout=timeout, multi_tenant=True, master_listen_fd=served
            )
        except BaseException:
            os.close(served)
            raise
        self.rendezvous = _StoreUntilJoined(store)
        self.backend = ProcessGroupGloo(PrefixStore(uri, self.rendezvous), 0, world_size, timeout=timeout)
        set_group_sequence_number(self.backend)  # the workers wait for rank 0's sequence number
        self.options = torch.distributed.BroadcastOptions()
        self.options.rootRank = 0
        self.timeout_s = timeout_s
        self.pending: list[Any] = []  # sends given up on

    def joined(self) -> None:
        """Every worker has joined (its end of the group is built): the rendezvous closes."""
        self.rendezvous.release()

    def broadcast(self, tensor: torch.Tensor, give_up: Callable[[], bool]) -> None:
        # A send completes only when the workers receive it: polled, so a worker that refused the chunk (its
        # `/update_weights` failed) is not waited for until the group's timeout.
        work = self.backend.broadcast([tensor], self.options)
        if _wait_until(work.is_completed, give_up, self.timeout_s + 5.0, "a gloo broadcast"):
            work.wait()  # raises the send's error, if it failed
        else:
            self.pending.append((work, tensor))

    def abandon(self) -> None:
        if self.pending:
            # Destroying a gloo group with a send in flight blocks until the send times out (`request_timeout_s`):
            # a failed server would stall the push, and the run's exit. Such a group is kept alive for good.
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(self))


class NcclGroup:
    """vLLM's NCCL communicator as rank 0 (needs vLLM and a GPU beside the trainer), on a stream of its own, so a
    broadcast that never completes (a worker that refused its chunk) can be given up on and the communicator
    aborted, instead of hanging the training stream."""

    def __init__(self, address: str, port: int, world_size: int, timeout_s: float, device: torch.device) -> None:
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        with torch.cuda.device(device):
            self.comm = trainer_init({"master_address": address, "master_port": port, "world_size": world_size})
            self.stream = torch.cuda.Stream(device)
        self.device = device
        self.timeout_s = timeout_s

    def broadcast(self, tensor: torch.Tensor, give_up: Callable[[], bool]) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the copy into `tensor` comes first
        self.comm.broadcast(tensor, src=0, stream=self.stream)
        tensor.record_stream(self.stream)
        sent = torch.cuda.Event()
        sent.record(self.stream)
        if not _wait_until(sent.query, give_up, self.timeout_s, "an NCCL broadcast"):
            self.abandon()

    def joined(self) -> None:
        pass  # vLLM's rendezvous: it binds the address alone, and stays open while the group lives

    def abandon(self) -> None:
        if self.comm is not None:
            self.comm.destroy()  # aborts the communicator: a broadcast stuck in it ends
            self.comm = None


def weight_chunks(
    named_tensors: Iterable[tuple[str, torch.Tensor]], chunk_bytes: int, device: torch.device, owned: bool = False
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The stream cut into chunks of at most `chunk_bytes` (a larger tensor is a chunk alone), each tensor a
    contiguous copy on `device` made as it arrives; with `owned` (the tensors are the caller's own copies, which
    nothing else changes) one already contiguous on `device` is taken as it is."""
    chunk: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        if owned and tensor.device == device and tensor.is_contiguous():
            copy = tensor
        else:
            copy = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device=device).copy_(tensor.detach())
        nbytes = copy.numel() * copy.element_size()
        if chunk and size + nbytes > chunk_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append((name, copy))
        size += nbytes
    if chunk:
        yield chunk


def host_copies(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Contiguous host copies of the whole stream: a staged version (asynchronous rollouts) that outlives the
    training step which made it, until the worker thread broadcasts it."""
    return [pair for chunk in weight_chunks(named_tensors, 2**62, torch.device("cpu")) for pair in chunk]


def chunk_info(chunk: Sequence[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """What `/update_weights` announces of a chunk (vLLM's NCCL and lit-rl's gloo engine read the same fields)."""
    return {
        "names": [name for name, _ in chunk],
        "dtype_names": [str(tensor.dtype).removeprefix("torch.") for _, tensor in chunk],
        "shapes": [list(tensor.shape) for _, tensor in chunk],
    }


class CollectiveTransfer:
    """Rank 0's side of the broadcast to every server (see the module docstring)."""

    def __init__(self, config: VLLMServer) -> None:
        self.kind = config.transfer.method
        self.address = config.transfer.address
        self.first_port = config.transfer.port
        self.timeout_s = config.request_timeout_s
        self.chunk_bytes = int(config.push_bucket_mib * 2**20)
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.kind == "nccl" else torch.device("cpu")
        self.order = {url: i for i, (url, _) in enumerate(config.server_endpoints())}
        self.groups: dict[str, TransferGroup] = {}  # server URL -> its group, once formed

    # -- groups ----------------------------------------------------------------------------------------------
    def connect(self, server: RolloutServer) -> None:
        """Form `server`'s group: learn its workers, clear what an earlier trainer may have left, ask the workers to
        join, and host the rendezvous meanwhile."""
        workers = self._count_workers(server)
        self._clear_stale_update(server)
        port = self.first_port + self.order[server.url] if self.first_port else 0
        # gloo: lit-rl's own store, on a socket bound here before the workers are told its port. nccl: vLLM's
        # `trainer_init` binds the address itself (its store stays open while the group lives).
        listener = listen(self.address, port) if self.kind == "gloo" else None
        port = listener.getsockname()[1] if listener else port or _free_port(self.address)
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
            group = self._open_group(listener, port, 1 + workers)
        except Exception as err:  # no worker came: the request's own error says why, if it has one
            joined.wait(timeout=5.0)
            raise ServerDownError(
                f"vLLM server {server.url}: its workers did not join the weight transfer at "
                f"{tcp_uri(self.address, port)} ({one_line(joined.error or err)}); can the server reach "
                "model.rollout.engine.transfer.address?"
            ) from None
        finally:
            if listener is not None:
                listener.close()  # the store serves its own copy until the workers have joined
        joined.result(self.timeout_s, server.url)
        group.joined()
        self.groups[server.url] = group

    def _open_group(self, listener: Optional[socket.socket], port: int, world_size: int) -> TransferGroup:
        if listener is None:
            return NcclGroup(self.address, port, world_size, self.timeout_s, self.device)
        return GlooGroup(listener, self.address, world_size, self.timeout_s)

    def _count_workers(self, server: RolloutServer) -> int:
        """How many workers `server` has (all its data-parallel replicas), after checking that each has a
        weight-transfer engine (`_check_weight_transfer_engine` raises on a worker without one)."""
        backend = VLLM_TRANSFER_BACKENDS[self.kind]
        try:
            rpc = {"method": "_check_weight_transfer_engine"}
            server.client.request("POST", "/collective_rpc", rpc, retries=0)
            answer = server.client.request("GET", "/get_world_size?include_dp=true", retries=0)
        except ServerDownError:
            server.client.check_health(self.timeout_s)  # down: raises ServerDownError; up: it has no engine
            answer = None
        except RolloutServerError:
            answer = None
        world_size = answer.get("world_size") if isinstance(answer, dict) else None
        if not isinstance(world_size, int) or world_size < 1:
            raise RolloutServerError(
                f"vLLM server {server.url} has no weight-transfer engine: start it with VLLM_SERVER_DEV_MODE=1 and "
                f'--weight-transfer-config \'{{"backend": "{backend}"}}\' '
                f"(model.rollout.engine.transfer.method: {self.kind})"
                + ("; lit-rl must be installed beside it, which registers the backend" if self.kind == "gloo" else "")
            )
        return world_size

    @staticmethod
    def _clear_stale_update(server: RolloutServer) -> None:
        """A server whose last update never finished (its trainer died, or a broadcast failed on the trainer's side)
        refuses to start another. vLLM ends an update only when `finish` succeeds or an `update_weights` fails inside
        the worker: a malformed one (its lists of unequal length) does, before any broadcast. Without an update in
        progress it is refused and changes nothing. Then the old group goes (`/shutdown_weight_transfer_engine`)."""
        malformed = {"update_info": {"names": ["-"], "dtype_names": [], "shapes": []}}
        for path, body in (("/update_weights", malformed), ("/shutdown_weight_transfer_engine", None)):
            try:
                server.client.request("POST", path, body, retries=0)
            except RolloutServerError:
                pass  # expected for the malformed update; the next request says whether the server is up

    def forget(self, server: RolloutServer) -> None:
        """Drop `server`'s group (it failed): it is formed again before the server next gets weights."""
        group = self.groups.pop(server.url, None)
        if group is not None:
            group.abandon()

    # -- pushes ----------------------------------------------------------------------------------------------
    def push(
        self,
        servers: Sequence[RolloutServer],
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        owned: bool = False,
    ) -> dict[RolloutServer, ServerDownError]:
        """Broadcast the weights to every one of `servers` at once, each paused throughout and resumed only once
        it has acknowledged all of them; the servers that failed, each with its error (left paused, groups
        dropped). Consumes the whole stream whatever fails (under ZeRO-3 it is a collective). `owned`: the tensors
        are copies of the caller's own (`host_copies`), sent without copying them again (`weight_chunks`)."""
        failed: dict[RolloutServer, ServerDownError] = {}
        paused: set[RolloutServer] = set()

        def begin(server: RolloutServer) -> None:
            if server.url not in self.groups:
                self.connect(server)
            server.client.request("POST", "/pause?mode=wait")
            paused.add(server)
            server.client.request("POST", "/start_weight_update", retries=0)

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
                    left = "; it is left paused rather than serve half-loaded weights" if server in paused else ""
                    failed[server] = ServerDownError(
                        f"vLLM server {server.url}: the weight transfer failed ({one_line(err, 300)}){left}"
                    )
                    self.forget(server)

            with ThreadPoolExecutor(max_workers=max(1, len(targets))) as pool:
                futures = [pool.submit(run, server) for server in targets]
            for future in futures:
                future.result()

        def live() -> list[RolloutServer]:
            return [server for server in servers if server not in failed]

        each(begin, servers)
        for chunk in weight_chunks(named_tensors, self.chunk_bytes, self.device, owned):
            each(lambda server: self._send(server, chunk), live())
        each(self._finish, live())
        return failed

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
        except RuntimeError:
            if received.wait(timeout=1.0) and received.error is not None:
                raise received.error from None  # the worker's own error says more than the broken send
            raise
        received.result(self.timeout_s, server.url)

    def _finish(self, server: RolloutServer) -> None:
        server.client.request("POST", "/finish_weight_update", {}, retries=0)
        server.client.reset_prefix_cache()
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


def listen(address: str, port: int) -> socket.socket:
    """A TCP socket listening on `address` alone (`port` 0: a free one), for a rendezvous store to serve."""
    sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen()
    except OSError as err:
        sock.close()
        raise RuntimeError(f"cannot listen on {tcp_uri(address, port)} for the weight transfer: {err}") from None
    return sock
