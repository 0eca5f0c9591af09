"""One vLLM server over HTTP: the command that starts one (`server_command`, `LocalVLLMServer`), and the JSON client
(`VLLMServerClient`) with a timeout on every request and retries with backoff. Imports no vLLM.

A server that does not answer (no connection, a timeout, or 5xx answers after the retries) raises `ServerDownError`,
which the engine's server pool (`lit_rl.rollout.server.pool`) may fail over from; any other error answer (4xx: the
request itself is wrong) raises `RolloutServerError` at once.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import re
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import weakref
from typing import Any, Callable, Optional, Sequence

from lit_rl.console import QUIET_SERVER_ENV
from lit_rl.errors import LitRLError, one_line
from lit_rl.net import AnswerTooLarge, error_answer, open_within, read_answer
from lit_rl.rollout.engines.vllm_config import VLLM_TRANSFER_BACKENDS
from lit_rl.rollout.server.listeners import port_holder


def server_command(
    model: str,
    port: int,
    host: str = "127.0.0.1",
    cpu: bool = True,
    weight_transfer: str = "file",
    extra_args: Sequence[str] = (),
    trust_remote_code: bool = False,
) -> tuple[list[str], dict]:
    """The documented command that starts a vLLM server lit-rl can drive: (argv, extra environment).

    `--logprobs-mode processed_logprobs` reports the log-probs of the distribution sampled from (what the
    trainer recomputes); `--generation-config vllm` ignores the repository's sampling defaults. With
    `weight_transfer` gloo or nccl (`model.rollout.engine.transfer.method`), `--weight-transfer-config` names the engine
    that receives the broadcast weights. `extra_args` come after the CPU defaults (`--dtype`, `--enforce-eager`), so
    they override them, and before lit-rl's own flags, which vLLM's parser lets win (the last value of a flag does).
    """
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    env = {"VLLM_SERVER_DEV_MODE": "1", "PYTHONSAFEPATH": "1"}  # PYTHONSAFEPATH: no working directory on sys.path
    env[QUIET_SERVER_ENV] = "1"  # its log without the notices of every weight push (`lit_rl.console`)
    if cpu:
        argv += ["--dtype", "float32", "--enforce-eager"]
        env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; yours wins
    argv += [*extra_args]
    argv += ["--model", model, "--served-model-name", "policy", "--host", host, "--port", str(port)]
    argv += ["--logprobs-mode", "processed_logprobs", "--generation-config", "vllm"]
    if weight_transfer in VLLM_TRANSFER_BACKENDS:
        argv += ["--weight-transfer-config", json.dumps({"backend": VLLM_TRANSFER_BACKENDS[weight_transfer]})]
    if trust_remote_code:  # the policy's own setting (`model.policy.trust_remote_code`): the same model's code
        argv += ["--trust-remote-code"]
    return argv, env


class LocalVLLMServer:
    """`server_command` started as a child process on 127.0.0.1 (at `port`, else at a free port, and another when
    another process takes it first: `start_server_child`), waited for until healthy; `stop()` ends it, with every
    process it started.

    It never outlives its starter: it runs in a session of its own (Ctrl-C in the terminal reaches the trainer, which
    stops it in order), `stop()` ends the whole session, the interpreter's exit calls `stop()` (a run that died with an
    exception skips Lightning's teardown), and on Linux the kernel sends it SIGTERM when the starter is killed
    (SIGKILL included). For `model.rollout.engine.launch`, tests and benchmarks; a shared or production server is
    started by its own supervisor.
    """

    def __init__(
        self,
        model: str,
        log_path: str,
        port: Optional[int] = None,
        cpu: bool = True,
        extra_args: Sequence[str] = (),
        timeout_s: float = 600,
        weight_transfer: str = "file",
        trust_remote_code: bool = False,
        cpus: Optional[set[int]] = None,
    ) -> None:
        def command(bound: int) -> tuple[list[str], dict]:
            argv, env = server_command(
                model,
                bound,
                cpu=cpu,
                weight_transfer=weight_transfer,
                extra_args=extra_args,
                trust_remote_code=trust_remote_code,
            )
            if cpus:  # the server's cores (`lit_rl.rollout.server.launch.core_split`): vLLM binds its threads there
                env[SERVER_CPUS_ENV] = ",".join(str(cpu) for cpu in sorted(cpus))
            return argv, env

        self.log_path = log_path
        self._child, failure = start_server_child(command, log_path, timeout_s, port=port)
        self.url, self.process = self._child.url, self._child.process
        if failure is not None:
            raise RolloutServerError(
                f"vLLM server {self.url} did not start: it {failure} ({_last_error(log_path)}); its log: {log_path}"
            )

    def stop(self) -> None:
        """End the server and everything it started (SIGTERM, then SIGKILL after 30 s); idempotent."""
        self._child.stop()


@dataclasses.dataclass
class ChildServer:
    """A server `start_server_child` started: its process, its URL, and `stop` (idempotent; run at exit at the
    latest)."""

    process: Any
    url: str
    stop: Callable[[], Any]


# A free port can be taken by another process before the child binds it (a vLLM server imports for tens of seconds
# first): a starter then tries another, this many ports in all, before the failure is the run's.
PORT_ATTEMPTS = 3


def start_server_child(
    command: Callable[[int], tuple[Sequence[str], dict]],
    log_path: str,
    timeout_s: float,
    port: Optional[int] = None,
    api_key: bool = True,
) -> tuple[ChildServer, Optional[str]]:
    """Start `command(port)` (argv, extra environment) as a child on 127.0.0.1 (`start_child`), and wait until it
    answers (`why_not_started`): the child and None, or the child (stopped) and why it did not start, for the
    caller's one-line error. Without `port`, a free port, and another when another process took it first (up to
    `PORT_ATTEMPTS`; each attempt rewrites `log_path`); a given `port` is the one the caller asked for, tried once.
    Ctrl-C while waiting stops the child."""
    for _ in range(1 if port else PORT_ATTEMPTS):
        bound = port or free_port()
        argv, env = command(bound)
        process, log = start_child(argv, env, log_path)
        stop = weakref.finalize(process, _stop_session, process, log)
        child = ChildServer(process, f"http://127.0.0.1:{bound}", stop)
        try:
            failure = why_not_started(process, child.url, timeout_s, api_key=api_key)
        except BaseException:  # never leave a server running behind Ctrl-C
            child.stop()
            raise
        if failure is None:
            return child, None
        child.stop()
        if not failure.startswith(PORT_TAKEN):
            break
    return child, failure


def start_child(argv: Sequence[str], env: dict[str, str], log_path: str) -> tuple[Any, Any]:
    """`argv` started with `env` added to this process's, in a session of its own, writing to `log_path`: the
    process and its open log (for `_stop_session`). On Linux, started from the main thread, the kernel sends it
    SIGTERM when this process dies, SIGKILL included."""
    import subprocess

    argv = list(argv)
    if sys.platform == "linux" and threading.current_thread() is threading.main_thread():
        # The kernel's parent-death signal follows the thread that started the child: the main thread lives
        # as long as the process does. (Set in a small exec wrapper: a preexec_fn is unsafe with threads.)
        argv = [sys.executable, "-c", _TERMINATE_WITH_PARENT, str(os.getpid()), *argv]
    log = open(log_path, "w")
    try:
        process = subprocess.Popen(
            argv, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    except BaseException:
        log.close()
        raise
    return process, log


# How `why_not_started` begins when another process took the port between `free_port` and the child's bind
# (`start_server_child` then tries another).
PORT_TAKEN = "found its port"


def why_not_started(process: Any, url: str, timeout_s: float, api_key: bool = True) -> Optional[str]:
    """Wait until the child `process` (`start_child`) serving `url` answers `/health`, for at most `timeout_s`:
    None, or why it did not start (`exited with code 1`, `did not answer within 60 s`), for the caller's one-line
    error. What answers after the process exited is another server, on the port it took first. Nothing is sent
    before the child listens on the port itself (`port_holder`): another process holding it is said at once.
    `api_key`: whether the poll sends `VLLM_API_KEY` (a vLLM server's)."""
    port = urllib.parse.urlsplit(url).port
    deadline = time.monotonic() + timeout_s
    while (holder := port_holder(port, process.pid)) == "none" and process.poll() is None:
        if time.monotonic() >= deadline:
            return f"did not answer within {timeout_s:g} s"
        time.sleep(0.2)
    if holder == "other":
        return f"{PORT_TAKEN} {port} taken by another process (nothing was sent there)"
    try:
        client = VLLMServerClient(url, timeout_s=2.0, max_retries=0, api_key=api_key)  # its `/health` poll
        client.wait_until_healthy(max(0.0, deadline - time.monotonic()), gone=lambda: process.poll() is not None)
        if process.poll() is None:
            return None
    except RolloutServerError:
        pass
    exit_code = process.poll()
    return f"did not answer within {timeout_s:g} s" if exit_code is None else f"exited with code {exit_code}"


# Run as `python -c` before the server's own command: SIGTERM when the starter dies (PR_SET_PDEATHSIG = 1, kept across
# exec), unless it is already gone (its pid, argv[1], is no longer the parent); onto the cores in SERVER_CPUS_ENV if
# set (inherited by every process the server starts); then exec the server in place.
SERVER_CPUS_ENV = "LIT_RL_SERVER_CPUS"
_TERMINATE_WITH_PARENT = (
    "import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGTERM); "
    "os.getppid() == int(sys.argv[1]) or sys.exit(1); "
    f"cpus = os.environ.pop('{SERVER_CPUS_ENV}', ''); "
    "cpus and os.sched_setaffinity(0, {int(cpu) for cpu in cpus.split(',')}); "
    "os.execv(sys.argv[2], sys.argv[2:])"
)


def _stop_session(process, log) -> None:
    """SIGTERM to the server's session (the API server and its engine processes), SIGKILL to whatever is left."""
    import signal
    import subprocess

    def signal_session(sig: int) -> None:
        try:
            os.killpg(process.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    if process.poll() is None:
        signal_session(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    signal_session(signal.SIGKILL)  # engine processes the API server left behind, if any
    process.wait()
    log.close()


def _last_error(log_path: str) -> str:
    """The server log's last line that names an error (else its last line), for the one-line error of a server
    that did not start: vLLM's traceback ends with the exception, often followed by a line of links."""
    try:
        with open(log_path, errors="replace") as handle:
            lines = [line.strip() for line in handle.readlines()[-50:] if line.strip()]
    except OSError:
        return "no log"
    # A link ("https://errors.pydantic.dev/...") names no error: vLLM's config errors end with one.
    errors = [line for line in lines if "error" in re.sub(r"https?://\S+", "", line).lower()]
    return (errors or lines or ["its log is empty"])[-1][:300]  # the start says what went wrong


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RolloutServerError(LitRLError):
    """The vLLM server could not be reached or answered with an error."""


# vLLM's own variable for `--api-key`: set where the trainer runs, it is sent as a bearer token to every server.
API_KEY_ENV = "VLLM_API_KEY"
MAX_ANSWER_BYTES = 1 << 30  # completions with their log-probs: tens of MB for a large batch


class ServerDownError(RolloutServerError):
    """The server did not answer: no connection, timeouts or 5xx answers, after every retry."""


class _RetryableError(Exception):
    pass


class VLLMServerClient:
    """JSON over HTTP to one vLLM server, with a timeout on every request and retries with backoff."""

    def __init__(self, base_url: str, timeout_s: float, max_retries: int, api_key: bool = True) -> None:
        """`api_key`: send `VLLM_API_KEY` (False for a server that is not a vLLM server, such as an OpenEnv app's:
        the key is not theirs to see)."""
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.api_key = api_key

    def request(self, method: str, path: str, body: Optional[dict] = None, retries: Optional[int] = None) -> Any:
        """Send one request, retrying connection failures, timeouts and 5xx answers; the parsed JSON answer."""
        url = f"{self.base_url}{path}"
        retries = self.max_retries if retries is None else retries
        for attempt in range(retries + 1):
            try:
                return self._once(method, url, body)
            except _RetryableError as err:
                if attempt == retries:
                    raise ServerDownError(
                        f"vLLM server {url}: {err} (after {attempt + 1} attempts, timeout {self.timeout_s:g} s "
                        "each); is the server running? (see model.rollout.engine.server_url)"
                    ) from None
                time.sleep(min(2.0**attempt, 30.0))

    def _once(self, method: str, url: str, body: Optional[dict], timeout_s: Optional[float] = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key and os.environ.get(API_KEY_ENV):  # a server started with --api-key, or a proxy before it
            headers["Authorization"] = f"Bearer {os.environ[API_KEY_ENV]}"
        request = urllib.request.Request(url, data=data, method=method, headers=headers)
        limit_s = min(timeout_s or self.timeout_s, self.timeout_s)
        deadline = time.monotonic() + limit_s  # for the whole answer, error answers included
        try:
            with open_within(request, limit_s, deadline) as response:
                payload = read_answer(response, MAX_ANSWER_BYTES, deadline)
        except AnswerTooLarge as err:
            raise RolloutServerError(f"vLLM server {url}: {err}") from None
        except urllib.error.HTTPError as err:
            message = _error_message(err, deadline)
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

    def reset_prefix_cache(self, wait_s: float = 10.0) -> None:
        """Drop the server's prefix cache, computed with the weights just replaced.

        vLLM refuses while KV blocks are still held (a request finishing, an asynchronous KV transfer) and says so
        only in its answer, `{"success": false}`: a cache kept would serve keys and values of the old weights for
        every prompt prefix it matches, a small, silent gap between the engine's log-probs and the trainer's. Asked
        again for up to `wait_s` seconds, then an error naming the server."""
        deadline = time.monotonic() + wait_s
        while True:
            answer = self.request("POST", "/reset_prefix_cache")
            if not isinstance(answer, dict) or answer.get("success", True):  # older servers answer nothing
                return
            if time.monotonic() >= deadline:
                raise RolloutServerError(
                    f"vLLM server {self.base_url}/reset_prefix_cache: still refused after {wait_s:g} s (KV blocks "
                    "held by requests that did not finish); its prefix cache would reuse keys and values computed "
                    "with the old weights. Is another client sending it requests?"
                )
            time.sleep(0.1)

    def check_health(self, timeout_s: float) -> None:
        """One `GET /health` within `timeout_s` (no retries); `ServerDownError` naming the URL if it fails."""
        url = f"{self.base_url}/health"
        try:
            self._once("GET", url, None, timeout_s=timeout_s)
        except _RetryableError as err:  # as a request's last retry says it: the run's one line, whichever came first
            raise ServerDownError(
                f"vLLM server {url}: {err} (health check before a generation); is the server running? (see "
                "model.rollout.engine.server_url)"
            ) from None
        except RolloutServerError as err:  # an error answer: it is up, but not healthy
            raise ServerDownError(f"{err} (health check before a generation)") from None

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
                    raise ServerDownError(
                        f"vLLM server {self.base_url}/health: {err} (waited {wait_s:g} s; "
                        "model.rollout.engine.wait_for_server_s); is the server running? (see "
                        "model.rollout.engine.server_url)"
                    ) from None
                time.sleep(1.0)


def _error_message(err: urllib.error.HTTPError, deadline: float) -> str:
    """The server's message in an error answer (its first `MAX_ERROR_BYTES`, read by `deadline`), on one line."""
    try:
        body = json.loads(error_answer(err, deadline) or b"{}")
    except ValueError:
        return str(err.reason)
    detail = body.get("error", body.get("detail", body)) if isinstance(body, dict) else body
    if isinstance(detail, dict):
        detail = detail.get("message", detail)
    return one_line(detail, 300)
