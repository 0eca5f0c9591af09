"""HTTP as lit-rl's clients use it (vLLM servers, weight receivers, reward servers): only the URL a config names,
answers of bounded size, read within a total time limit.

- `DIRECT` ignores proxy variables (`http_proxy` would receive completions or weights) and follows no redirect
  (a redirect would send the request, and its bearer token, to another host): a 3xx is an `HTTPError`.
- `read_answer` reads at most `limit` bytes (`AnswerTooLarge` past it) and stops at `deadline` however slowly the
  server sends (a socket timeout is per read: a server sending a byte at a time would hold it forever).
- `error_answer` reads an error answer's body (an `HTTPError`) the same way, keeping its first `MAX_ERROR_BYTES`: an
  error is a message, and a server that sends a huge or endless one must not hold the client.
"""

from __future__ import annotations

import http.client
import time
import urllib.error
import urllib.request
from typing import Any


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())
_READ = 1 << 16
MAX_ERROR_BYTES = 1 << 16  # of an error answer's body: its message is in the first few hundred bytes


class AnswerTooLarge(ValueError):
    """An answer longer than the client accepts."""


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
            raise TimeoutError("timed out: the answer did not arrive within the time limit")
        chunk = response.read1(_READ)  # what one receive brings: the deadline is checked between receives
        if not chunk:
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
