"""HTTP as lit-rl's clients use it (vLLM servers, weight receivers, reward servers): only the URL a config names,
answers of bounded size, read within a total time limit.

- `open_within` opens a request ignoring proxy variables (`http_proxy` would receive completions or weights) and
  following no redirect (a redirect would send the request, and its bearer token, to another host: a 3xx is an
  `HTTPError`), with its connection shut down at `deadline`: http.client reads the status line and headers itself,
  with the socket's timeout per receive, so a server trickling its headers a byte at a time would hold the client
  for ever.
- `read_answer` reads at most `limit` bytes (`AnswerTooLarge` past it) and stops at `deadline` however slowly the
  server sends (a socket timeout is per read: a server sending a byte at a time would hold it forever).
- `error_answer` reads an error answer's body (an `HTTPError`) the same way, keeping its first `MAX_ERROR_BYTES`: an
  error is a message, and a server that sends a huge or endless one must not hold the client.
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from typing import Any, Iterator, Optional


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_READ = 1 << 16
MAX_ERROR_BYTES = 1 << 16  # of an error answer's body: its message is in the first few hundred bytes


class AnswerTooLarge(ValueError):
    """An answer longer than the client accepts."""


TIMED_OUT = "timed out: the answer did not arrive within the time limit"


class _Watchdog:
    """Shuts a connection down at `deadline` (`time.monotonic()`), from a timer thread of its own."""

    def __init__(self, deadline: float) -> None:
        self.deadline, self.fired = deadline, False
        self._timer: Optional[threading.Timer] = None
        self._sock: Optional[socket.socket] = None

    def watch(self, sock: socket.socket) -> None:
        """Watch the connection of `sock`, through a descriptor of its own: still the connection's once TLS takes
        `sock` over (its handshake is watched too), and never another connection's when `sock` is closed."""
        self.cancel()
        self._sock = sock.dup()
        self._timer = threading.Timer(max(self.deadline - time.monotonic(), 0.0), self._shut)
        self._timer.daemon = True
        self._timer.start()

    def _shut(self) -> None:
        self.fired = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # a blocked receive returns at once; the owner closes the socket
        except OSError:  # closed meanwhile (`cancel`), or the connection already gone
            pass

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._sock is not None:
            self._sock.close()


def _watched(connection_class: type, watchdog: _Watchdog) -> type:
    """`connection_class` whose plain socket `watchdog` watches from the moment it connects (an HTTPS connection's
    `connect` calls this one's before its TLS handshake)."""

    class Armed(http.client.HTTPConnection):
        def connect(self) -> None:
            super().connect()
            watchdog.watch(self.sock)

    if connection_class is http.client.HTTPConnection:
        return Armed
    return type("Watched", (connection_class, Armed), {})


class _WatchedHTTP(urllib.request.HTTPHandler):
    def __init__(self, watchdog: _Watchdog) -> None:
        super().__init__()
        self.watchdog = watchdog

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_watched(http.client.HTTPConnection, self.watchdog), req)


class _WatchedHTTPS(urllib.request.HTTPSHandler):
    def __init__(self, watchdog: _Watchdog) -> None:
        super().__init__()
        self.watchdog = watchdog

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_watched(http.client.HTTPSConnection, self.watchdog), req, context=self._context)


@contextmanager
def open_within(request: urllib.request.Request, timeout_s: float, deadline: float) -> Iterator[Any]:
    """`request` opened (no proxy, no redirect: module docstring), its connection shut down when `time.monotonic()`
    passes `deadline`, status line and headers included; a failure after that is a `TimeoutError` (`TIMED_OUT`). An
    `HTTPError` (an answer, whose body `error_answer` reads by the same deadline) goes on as it is."""
    watchdog = _Watchdog(deadline)
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({}), _NoRedirect(), _WatchedHTTP(watchdog), _WatchedHTTPS(watchdog)
    )
    try:
        with opener.open(request, timeout=timeout_s) as response:
            yield response
    except urllib.error.HTTPError:
        raise
    except (OSError, http.client.HTTPException):  # the connection's failures, not the caller's own (bad JSON)
        if watchdog.fired:
            raise TimeoutError(TIMED_OUT) from None
        raise
    finally:
        watchdog.cancel()


def read_answer(response: http.client.HTTPResponse, limit: int, deadline: float) -> bytes:
    """The body of `response`: at most `limit` bytes, read before `time.monotonic()` passes `deadline`
    (`TimeoutError`); an answer cut short raises `http.client.IncompleteRead`, as `read()` does."""
    declared = response.getheader("Content-Length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise AnswerTooLarge(f"the answer is {int(declared)} bytes, more than the {limit} accepted")
    chunks: list[bytes] = []
    total = 0
    while True:
        if time.monotonic() > deadline:
            raise TimeoutError(TIMED_OUT)
        chunk = response.read1(_READ)  # what one receive brings: the deadline is checked between receives
        if not chunk:
            if time.monotonic() > deadline:  # the connection shut down at the deadline (`open_within`)
                raise TimeoutError(TIMED_OUT)
            break
        total += len(chunk)
        if total > limit:
            raise AnswerTooLarge(f"the answer is more than the {limit} bytes accepted")
        chunks.append(chunk)
    if declared is not None and declared.isdigit() and total < int(declared):  # read1 returns b"" when cut short
        raise http.client.IncompleteRead(b"".join(chunks), int(declared) - total)
    return b"".join(chunks)


def error_answer(err: urllib.error.HTTPError, deadline: float, limit: int = MAX_ERROR_BYTES) -> bytes:
    """At most `limit` bytes of an error answer's body, read before `time.monotonic()` passes `deadline` (give or
    take one receive); what arrived by then (possibly nothing) if the server sends more, too slowly, or breaks off.
    The connection is closed after. Never raises."""
    response = getattr(err, "fp", None)
    read1 = getattr(response, "read1", None)
    chunks: list[bytes] = []
    total = 0
    try:
        while read1 is not None and total < limit and time.monotonic() < deadline:
            chunk = read1(min(_READ, limit - total))
            if not chunk:
                break
            total += len(chunk)
            chunks.append(chunk)
    except (OSError, http.client.HTTPException, ValueError):
        pass
    finally:
        try:
            err.close()  # the rest is not read: the connection is not reused
        except (OSError, http.client.HTTPException, ValueError):
            pass
    return b"".join(chunks)
