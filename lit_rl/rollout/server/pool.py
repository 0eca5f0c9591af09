"""The vLLM servers of one run (`model.rollout.engine.server_url` or `server_urls`): which are in service, health
checks, dealing requests out across them, weights to every one, and what a failed server does to the run.

- **Dealing.** The requests (each a prompt, its seed and `n`) go round the `M` servers in service in turn, from
  where the last call left off (independent episodes send one request a call). A request's completions depend
  only on the request (vLLM seeds child `j` with `seed + j`), so the split changes which server samples them,
  never what is sampled. At most `MAX_REQUESTS_PER_SERVER` x the servers configured are in flight at once,
  across all calls of one process (with a server out of service, the others take its share; each rank that sends
  its own requests has its own bound).
- **Failure** (`model.rollout.engine.on_server_failure`). A server that does not answer (`ServerDownError`: no
  connection, timeouts or 5xx after the retries, a failed health check, or a failed weight upload) either stops the
  run in one line naming its URL (`fail`), or (`continue`) is taken out of service for the rest of the run with a
  one-line warning, and its requests, the one that failed included, go to the next server in service. The last server in
  service is never taken out: its failure stops the run. A server out of service that answers its health check
  again (its supervisor restarted it) is taken back at the next weight push, once it has loaded the weights
  (`recover`, `readmit`).
- **Weights.** A push reaches every server in service at once. Servers that share a weight receiver (on one
  machine) get one upload between them.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, TypeVar

from lit_rl.rollout.engine_config import VLLMServer
from lit_rl.rollout.server.client import RolloutServerError, ServerDownError, VLLMServerClient
from lit_rl.rollout.server.weight_receiver import WeightTransferError, WeightUploader

log = logging.getLogger(__name__)

MAX_REQUESTS_PER_SERVER = 16  # requests in flight per server configured, across all `deal` calls at once
HEALTH_TIMEOUT_S = 10.0  # at most this long for one health check (or `request_timeout_s`, if shorter)

Job = TypeVar("Job")
Result = TypeVar("Result")


@dataclass(eq=False)
class RolloutServer:
    """One server and what the engine knows of it."""

    client: VLLMServerClient
    receiver: Optional[str]  # the URL of its weight receiver; None: it reads the trainer's files directly
    model_name: Optional[str] = None
    in_service: bool = True
    loaded: Optional[int] = None  # the staged version it holds (asynchronous rollouts); None after a plain push

    @property
    def url(self) -> str:
        return self.client.base_url


class ServerPool:
    """The servers of `config.server_endpoints()`, and the rules of the module docstring."""

    def __init__(self, config: VLLMServer, first_server: int = 0) -> None:
        self.on_failure = config.on_server_failure
        self.health_timeout_s = min(config.request_timeout_s, HEALTH_TIMEOUT_S)
        self.servers = [
            RolloutServer(VLLMServerClient(url, config.request_timeout_s, config.max_retries), receiver)
            for url, receiver in config.server_endpoints()
        ]
        self.uploaders = {
            receiver: WeightUploader(receiver, config.request_timeout_s, config.max_retries)
            for receiver in dict.fromkeys(server.receiver for server in self.servers)
            if receiver is not None
        }
        # (receiver, tag) -> where that receiver holds the weights uploaded as `tag`; a receiver that misses an upload
        # of a tag loses its record of it (its copy is older), so every record is the latest upload of its tag.
        self.copies: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()
        self._upload_lock = threading.Lock()  # one upload of a (receiver, tag) at a time: see `receiver_copy`
        self._next = first_server  # where the next `deal` starts round the servers
        # The bound on requests in flight, shared by every `deal` (a request waiting for a slot has not started:
        # its time limit has not either).
        self._in_flight = threading.Semaphore(MAX_REQUESTS_PER_SERVER * len(self.servers))
        self._request_timeout_s, self._max_retries = config.request_timeout_s, config.max_retries

    def move(self, server: RolloutServer, url: str) -> None:
        """`server` is at `url` (a launched server's port, known once it started): its requests go there."""
        if server.url != url:
            server.client = VLLMServerClient(url, self._request_timeout_s, self._max_retries)

    def in_service(self) -> list[RolloutServer]:
        return [server for server in self.servers if server.in_service]

    def take_out(self, server: RolloutServer, err: Exception) -> None:
        """`server` failed with `err`: stop the run (`fail`, or no other server left) with one line, or warn and take
        it out of service."""
        with self._lock:
            if not server.in_service:
                return  # another of its requests got here first
            others = [s for s in self.servers if s.in_service and s is not server]
            if self.on_failure == "fail" or len(self.servers) == 1:
                raise RolloutServerError(str(err))
            if not others:
                raise RolloutServerError(
                    f"{err}; no other vLLM server is left in service (model.rollout.engine.server_urls)"
                )
            server.in_service = False
            log.warning(
                "%s; taken out of service: its requests go to the %d other server(s) for the rest of the run "
                "(model.rollout.engine.on_server_failure: continue)",
                err,
                len(others),
            )

    def recover(self) -> list[RolloutServer]:
        """The servers out of service that answer one health check now (no retries, no warning when they do not)."""
        answering = []
        for server in (s for s in self.servers if not s.in_service):
            try:
                server.client.check_health(self.health_timeout_s)
            except ServerDownError:
                continue
            answering.append(server)
        return answering

    def readmit(self, servers: Sequence[RolloutServer], load: Callable[[RolloutServer], None]) -> None:
        """Put each of `servers` back in service once `load(server)` gave it the current weights (a server that
        fails to load stays out, silently: it is tried again at the next push)."""
        for server in servers:
            try:
                load(server)
            except (RolloutServerError, WeightTransferError):  # e.g. restarted without the RL endpoints: not yet
                continue
            with self._lock:
                server.in_service = True
            log.warning("vLLM server %s answers again: back in service with the current weights", server.url)

    def connect(self, wait_s: float) -> None:
        """Wait for every server to answer `/health` (each may still be starting) and learn its model's name."""

        def connect_one(server: RolloutServer) -> None:
            server.client.wait_until_healthy(wait_s)
            try:
                server.model_name = server.client.request("GET", "/v1/models")["data"][0]["id"]
            except (KeyError, IndexError, TypeError):
                raise RolloutServerError(f"vLLM server {server.url}/v1/models lists no model") from None

        self.on_each(connect_one)

    def check_health(self) -> None:
        """One `/health` request to every server in service, all at once, before a generation."""
        self.on_each(lambda server: server.client.check_health(self.health_timeout_s))

    def on_each(self, fn: Callable[[RolloutServer], None], servers: Optional[Sequence[RolloutServer]] = None) -> None:
        """`fn(server)` for every server in service (or each of `servers`), all at once; a server `fn` finds down
        is taken out (`take_out`). Returns when every call has ended."""

        def run(server: RolloutServer) -> None:
            try:
                fn(server)
            except (ServerDownError, WeightTransferError) as err:
                self.take_out(server, err)

        targets = list(self.in_service() if servers is None else servers)
        if len(targets) == 1:
            run(targets[0])
            return
        with ThreadPoolExecutor(max_workers=max(1, len(targets))) as pool:
            futures = [pool.submit(run, server) for server in targets]
        for future in futures:
            future.result()  # the first failure that stops the run, after all have ended

    def deal(self, jobs: Sequence[Job], fn: Callable[[RolloutServer, Job], Result]) -> list[Result]:
        """`fn(server, job)` for every job, all at once, the jobs dealt round the servers in service (module
        docstring); a job whose server goes down is taken to the next one in service. The results in the jobs'
        order; the first failure that stops the run cancels the jobs not yet started."""
        with self._lock:
            start, self._next = self._next, self._next + len(jobs)

        def run(index: int, job: Job) -> Result:
            with self._in_flight:
                while True:
                    servers = self.in_service()  # never empty: the last server is never taken out
                    server = servers[(start + index) % len(servers)]
                    try:
                        return fn(server, job)
                    except ServerDownError as err:
                        self.take_out(server, err)

        if len(jobs) == 1:  # on this thread: an independent episode's turn needs no pool of its own
            return [run(0, jobs[0])]
        workers = max(1, min(MAX_REQUESTS_PER_SERVER * len(self.in_service()), len(jobs)))
        pool = ThreadPoolExecutor(max_workers=workers)
        try:
            futures = [pool.submit(run, index, job) for index, job in enumerate(jobs)]
            return [future.result() for future in futures]
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def upload(self, directory: str, tag: str) -> None:
        """Upload the weights in `directory` as `tag` to the receiver of every server in service (once per
        receiver) and record where it stored them (`copies`); a failed upload takes its servers out (`take_out`)."""
        by_receiver: dict[str, list[RolloutServer]] = {}
        for server in self.in_service():
            if server.receiver is not None:
                by_receiver.setdefault(server.receiver, []).append(server)
        for receiver in set(self.uploaders) - set(by_receiver):
            self.copies.pop((receiver, tag), None)  # it misses this upload: what it holds of `tag` is older
        if not by_receiver:
            return

        def upload_to(receiver: str) -> None:
            try:
                self.copies[(receiver, tag)] = self.uploaders[receiver].upload(directory, tag)
            except WeightTransferError as err:
                self.copies.pop((receiver, tag), None)
                for server in by_receiver[receiver]:
                    self.take_out(server, err)

        with ThreadPoolExecutor(max_workers=len(by_receiver)) as pool:
            futures = [pool.submit(upload_to, receiver) for receiver in by_receiver]
        for future in futures:
            future.result()

    def receiver_copy(self, receiver: str, directory: str, tag: str) -> str:
        """Where `receiver` holds the weights of `tag`: its recorded copy, or a new upload of `directory` (one at a
        time, so servers sharing a receiver never upload the same tag into it at once)."""
        with self._upload_lock:
            if (receiver, tag) not in self.copies:
                self.copies[(receiver, tag)] = self.uploaders[receiver].upload(directory, tag)
            return self.copies[(receiver, tag)]

    def forget(self, tag: str) -> None:
        """Drop the records of `tag` and have the receivers delete their copies (best effort)."""
        for receiver in self.uploaders:
            self.copies.pop((receiver, tag), None)
        for receiver in {server.receiver for server in self.in_service() if server.receiver is not None}:
            try:
                self.uploaders[receiver].delete(tag)
            except WeightTransferError as err:  # a stale copy costs the receiver's disk, not the run
                log.warning("could not delete weights %s at %s: %s", tag, receiver, err)
