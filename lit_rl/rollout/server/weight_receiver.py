"""Weights for a vLLM server on another machine, over HTTP: a receiver beside the server, and the trainer's uploader.

The vLLM server engine has the server reload the policy from a directory (`reload_weights`). When the server shares
the trainer's machine that directory is written in place (`model.rollout.engine.transfer.sync_dir`, `/dev/shm` by
default); otherwise a receiver runs next to the server and the trainer uploads the files to it
(`model.rollout.engine.transfer.method: http`, `model.rollout.engine.transfer.receiver_url`):

    python -m lit_rl.rollout.server.weight_receiver --dir /dev/shm/lit-rl-weights --port 8010   # on the server's
    machine

An upload of version `tag` sends each file with `PUT /files/<tag>/<name>` and its SHA-256 (`X-Content-SHA256`),
into a staging directory (up to 4 files at once); the receiver checks every file's digest as it arrives.
`POST /commit/<tag>` with the expected `{name: sha256}` then checks the set is complete, with the digests checked
on arrival (it hashes again only a file it has no record of, after a restart), and moves the staging directory to
`<dir>/<tag>.<n>` in one rename (a new name for every commit: a committed version is never written again, so
the path answered holds the trainer's bytes until the trainer's next commit of that tag replaces it), and answers
that path, which the trainer hands to the server's reload. A transfer that fails (a timeout, a digest that does not
match, a lost connection) never reaches the commit: the server keeps serving the weights it has, and the trainer
stops with one line naming the URL. `DELETE /files/<tag>` removes a tag's versions (the numbers, one sequence for
every tag, go on: none is given twice, `next_number`).

Who may write: the receiver binds to 127.0.0.1 unless told otherwise (`--host`). Bound to any other address it
requires `Authorization: Bearer <token>` (`LIT_RL_RECEIVER_TOKEN`, set on both sides; without one it makes one and
prints it once), compared in constant time. The token travels in clear HTTP: across machines, use a private
network or a tunnel. The uploader follows no redirect (one would carry the token elsewhere).

What it bounds: a file's `Content-Length` (`--max-file-gib`), the bytes under `--dir` (`--max-total-gib`: an upload
reserves its bytes before it is accepted, so uploads at once cannot overrun it together), the staging folders at once
(`MAX_STAGING`), a commit's body, the time a connection may stall (`REQUEST_TIMEOUT_S`) and connections at once, in
two pools so that an outsider without the token cannot stop the trainer's uploads (`_BoundedServer`): until its
request line and headers are in and its token checked, a connection holds a waiting slot (`MAX_WAITING` in all,
`MAX_WAITING_PER_PEER` from one address, each for at most `HEAD_DEADLINE_S` however slowly the bytes come); then a
serving slot (`MAX_CONNECTIONS`), whose body must arrive within `REQUEST_TIMEOUT_S` plus its length at
`MIN_BODY_BYTES_PER_S` (256 KiB/s a stream). More are answered 503 at once. An outsider with many addresses can
still keep the waiting pool full, and then every new connection, the trainer's too, is answered 503: bind the
receiver where only the trainer reaches it. `--dir` is created private (0700), must belong to this user, and nothing
under it may be a symbolic link; names are checked, so nothing is written outside it. Staging folders left by uploads
that never committed are removed after `STALE_STAGING_S` (looked for at start and at most once a minute after). A
file lands in its staging folder under the commit lock, so a commit never moves bytes other than those it checked.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import http.client
import ipaddress
import json
import os
import re
import secrets
import shutil
import socket
import stat
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Optional

from lit_rl.errors import LitRLError, one_line
from lit_rl.net import AnswerTooLarge, error_answer, open_within, read_answer

TOKEN_ENV = "LIT_RL_RECEIVER_TOKEN"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_CHUNK = 1 << 20
UPLOAD_STREAMS = 4  # files sent at once
GIB = 1 << 30
MAX_COMMIT_BYTES = 1 << 20  # a commit names files and digests: kilobytes
MAX_CONNECTIONS = 16  # requests served at once (their token checked); the trainer uses UPLOAD_STREAMS
MAX_WAITING = 64  # connections whose request line and headers are not in (or not checked) yet
MAX_WAITING_PER_PEER = 8  # of those, from one address: one outsider cannot hold them all
HEAD_DEADLINE_S = 10.0  # a request line and headers not in by then are cut, however slowly they trickle
REQUEST_TIMEOUT_S = 60.0  # a connection that sends nothing for this long is dropped, its partial file removed
MIN_BODY_BYTES_PER_S = 256 << 10  # a served request's body must come within REQUEST_TIMEOUT_S + its length at this
STALE_STAGING_S = 3600.0  # a staging folder untouched this long belongs to an upload that will not commit
STALE_SWEEP_S = 60.0  # how often uploads look for stale staging folders
MAX_STAGING = 64  # staging folders at once: the trainer keeps one or two (a version and the next)
PARTIAL_PREFIX = ".part-"  # `.part-<tag>-<random>.part`: a file still arriving, beside the staging folders
LAST_NUMBER_FILE = ".last-number"  # the last version number a commit was given (of any tag)


class WeightTransferError(LitRLError):
    """An upload of the policy's weights that did not complete; the message names the receiver's URL."""


def sha256_of(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


# -- the receiver, beside the server ------------------------------------------------------------------------------
class WeightReceiver:
    """Serves uploads into `root` on `host:port` (0: a free port) until `stop`; the module docstring says what it
    checks and bounds. `token` None reads `LIT_RL_RECEIVER_TOKEN`; bound to a non-loopback address without one, it
    makes one (`generated_token`, to be shown to the user once)."""

    def __init__(
        self,
        root: str | Path,
        host: str = "127.0.0.1",
        port: int = 0,
        token: Optional[str] = None,
        max_file_bytes: int = 64 * GIB,
        max_total_bytes: int = 256 * GIB,
    ) -> None:
        self.root = private_directory(Path(root))
        self.token = token if token is not None else os.environ.get(TOKEN_ENV)
        self.generated_token: Optional[str] = None
        if not self.token and not is_loopback(host):
            self.token = self.generated_token = secrets.token_urlsafe(32)
        self.max_file_bytes, self.max_total_bytes = max_file_bytes, max_total_bytes
        self.server = _BoundedServer((host, port), _handler(self))
        self.url = f"http://{host}:{self.server.server_port}"
        self.verified: dict[Path, str] = {}  # staged file -> the SHA-256 checked as it arrived (commit trusts it)
        self.commit_lock = threading.Lock()  # commits, deletes and a file's landing move files: one at a time
        self.space_lock = threading.Lock()  # `reserved` and the check against `max_total_bytes`
        self.staging_lock = threading.Lock()  # counting, sweeping and making staging folders
        self.reserved = 0  # bytes of the uploads accepted and not yet landed (or removed)
        remove_stale_staging(self.root)
        self.last_sweep = time.monotonic()

    def serve_forever(self) -> None:
        self.server.serve_forever()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def staging(self, tag: str) -> Path:
        return self.root / f".incoming-{tag}"

    def authorized(self, header: Optional[str]) -> bool:
        if not self.token:
            return True
        return hmac.compare_digest((header or "").encode(), f"Bearer {self.token}".encode())

    def bytes_stored(self) -> int:
        """The bytes of the regular files under the receiver's directory, but the partial files of uploads under way
        (their whole length is reserved). Other requests add,
        rename and remove files meanwhile (a partial file becomes its name, a staging folder a version): a file or
        folder gone between the listing and its `lstat` is not counted, where it used to end the request."""
        total = 0
        for folder, _, names in os.walk(self.root):  # a folder gone mid-walk is skipped, links are not followed
            for name in names:
                if name.startswith(PARTIAL_PREFIX):  # still arriving: its whole length is reserved (`reserve`)
                    continue
                try:
                    status = os.lstat(os.path.join(folder, name))
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(status.st_mode):
                    total += status.st_size
        return total

    def reserve(self, nbytes: int) -> bool:
        """Take `nbytes` of the byte budget for an upload (False: it would overrun `max_total_bytes`); `release`
        gives them back once the file landed, and counts among the bytes stored, or was removed."""
        with self.space_lock:
            if self.bytes_stored() + self.reserved + nbytes > self.max_total_bytes:
                return False
            self.reserved += nbytes
            return True

    def release(self, nbytes: int) -> None:
        with self.space_lock:
            self.reserved -= nbytes

    def forget_digests(self, folder: Path) -> None:
        """Drop the digests recorded for the files of a staging folder that was removed."""
        for path in [p for p in list(self.verified) if p.parent == folder]:
            self.verified.pop(path, None)

    def open_staging(self, tag: str) -> Optional[Path]:
        """`tag`'s staging folder, made when new unless `MAX_STAGING` exist (None); stale ones are swept first, at
        most once per `STALE_SWEEP_S`."""
        with self.staging_lock:
            if time.monotonic() - self.last_sweep > STALE_SWEEP_S:
                for folder in remove_stale_staging(self.root):
                    self.forget_digests(folder)
                self.last_sweep = time.monotonic()
            staging = self.staging(tag)
            if not staging.exists() and len(list(self.root.glob(".incoming-*"))) >= MAX_STAGING:
                return None
            staging.mkdir(mode=0o700, exist_ok=True)
            return staging

    def next_number(self, found: list[int]) -> int:
        """The version number of a commit (under the commit lock): one sequence for every tag, recorded in
        `.last-number` under the receiver's directory, never given twice, past a DELETE and a restart of the
        receiver too, so a path answered to the trainer never comes to hold other bytes (a tag's commits would else
        count from 1 again after a DELETE, up to it). `found`: the numbers of the tag's versions on disk (a
        directory of an earlier receiver without the record)."""
        record = self.root / LAST_NUMBER_FILE
        try:
            recorded = int(record.read_text()) if not record.is_symlink() else 0
        except (FileNotFoundError, ValueError):
            recorded = 0
        number = 1 + max([*found, recorded])
        written = self.root / f"{LAST_NUMBER_FILE}.new"
        written.unlink(missing_ok=True)
        written.write_text(str(number))
        os.replace(written, record)  # whole or not at all: a receiver killed mid-write keeps the old number
        return number

    def versions(self, tag: str) -> list[Path]:
        """The committed directories of `tag`, oldest first."""
        found = [(int(m.group(1)), p) for p in self.root.iterdir() if (m := _version_of(tag).match(p.name))]
        return [path for _, path in sorted(found)]


def _version_of(tag: str) -> re.Pattern[str]:
    return re.compile(rf"^{re.escape(tag)}\.(\d+)$")


def is_loopback(host: str) -> bool:
    """Whether binding `host` serves this machine only (`""` binds every interface)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def private_directory(root: Path, what: str = "weight receiver directory") -> Path:
    """`root`, created 0700 if it does not exist; refused (one line naming it as `what`) when it is a symbolic
    link, belongs to another user, or others may write into it."""
    if root.is_symlink():
        raise LitRLError(f"{what} {root} is a symbolic link: give the directory itself")
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = root.lstat()
    if info.st_uid != os.getuid():
        raise LitRLError(f"{what} {root} belongs to another user (uid {info.st_uid})")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise LitRLError(f"{what} {root} is writable by others: chmod 700 it")
    return root


def remove_stale_staging(root: Path, older_than_s: Optional[float] = None) -> list[Path]:
    """Remove the staging folders, and partial files, of uploads untouched for `older_than_s` (None:
    `STALE_STAGING_S`): a staging folder counts as touched when it, a file in it, or a partial file of its tag
    changed. The folders removed."""
    older_than_s = STALE_STAGING_S if older_than_s is None else older_than_s
    now = time.time()

    def touched(path: Path) -> float:
        try:
            return path.lstat().st_mtime
        except FileNotFoundError:
            return now  # gone meanwhile: not stale

    removed = []
    for path in root.glob(".incoming-*"):
        if not path.is_dir() or path.is_symlink():
            continue
        tag = path.name[len(".incoming-") :]
        latest = max(
            [touched(path), *map(touched, path.iterdir()), *map(touched, root.glob(f"{PARTIAL_PREFIX}{tag}-*"))]
        )
        if now - latest > older_than_s:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    for partial in root.glob(f"{PARTIAL_PREFIX}*"):
        if now - touched(partial) > older_than_s:
            partial.unlink(missing_ok=True)
    return removed


def _no_links_under(path: Path, root: Path) -> bool:
    """Whether `path` and every directory between it and `root` is a real directory or file, no symbolic link."""
    current = path
    while current != root:
        if current.is_symlink():
            return False
        current = current.parent
    return True


class _BoundedServer(ThreadingHTTPServer):
    """A thread per connection (one request each), in two pools (module docstring): waiting until the request's
    head is in and its token checked (`MAX_WAITING`, `MAX_WAITING_PER_PEER`), then serving (`admit`,
    `MAX_CONNECTIONS`). A connection that finds its pool full is answered 503 at once."""

    daemon_threads = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.slots_lock = threading.Lock()
        self.waiting: dict[str, int] = {}  # address -> its connections in the waiting pool
        self.serving: set[Any] = set()  # the connections admitted

    def process_request(self, request: Any, client_address: Any) -> None:
        peer = client_address[0]
        with self.slots_lock:
            free = sum(self.waiting.values()) < MAX_WAITING and self.waiting.get(peer, 0) < MAX_WAITING_PER_PEER
            if free:
                self.waiting[peer] = self.waiting.get(peer, 0) + 1
        if free:
            try:
                super().process_request(request, client_address)
            except BaseException:  # no thread to release it: the slot is given back here
                with self.slots_lock:
                    self._leave_waiting(peer)
                raise
            return
        try:
            request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        except OSError:
            pass
        finally:
            self.shutdown_request(request)

    def admit(self, request: Any, peer: str) -> bool:
        """Move a connection whose token is checked from the waiting pool to the serving one; False (it stays
        waiting) when MAX_CONNECTIONS are served."""
        with self.slots_lock:
            if len(self.serving) >= MAX_CONNECTIONS:
                return False
            self._leave_waiting(peer)
            self.serving.add(request)
            return True

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.slots_lock:
                if request in self.serving:
                    self.serving.discard(request)
                else:
                    self._leave_waiting(client_address[0])

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):  # a client gone, stalled or cut
            return
        super().handle_error(request, client_address)

    def _leave_waiting(self, peer: str) -> None:
        self.waiting[peer] -= 1
        if not self.waiting[peer]:
            del self.waiting[peer]


class _Deadline:
    """Cuts a connection (shuts its socket down, so a blocked read returns) when `seconds` pass before `cancel`:
    a per-read timeout alone lets a client that sends a byte at a time hold a connection for ever."""

    def __init__(self, connection: Any, seconds: float) -> None:
        self.fired = self.cancelled = False
        self.lock = threading.Lock()  # a cut and a cancel at the same moment: one of them, never both
        self.timer = threading.Timer(min(seconds, threading.TIMEOUT_MAX), self._cut, args=(connection,))
        self.timer.daemon = True
        self.timer.start()

    def _cut(self, connection: Any) -> None:
        with self.lock:
            if self.cancelled:
                return
            self.fired = True
        try:
            connection.shutdown(socket.SHUT_RDWR)
        except OSError:  # closed already
            pass

    def cancel(self) -> None:
        """Stop the deadline (`fired` says whether it had cut the connection already)."""
        with self.lock:
            self.cancelled = True
        self.timer.cancel()


def _handler(receiver: WeightReceiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = REQUEST_TIMEOUT_S  # the socket's: a stalled read raises, and the request's partial file goes

        def setup(self) -> None:
            super().setup()
            self.deadline = _Deadline(self.connection, HEAD_DEADLINE_S)  # for the request line and headers

        def parse_request(self) -> bool:
            parsed = super().parse_request()  # the headers are read by now (or the head was cut)
            self.deadline.cancel()
            return parsed and not self.deadline.fired  # a cut head ends at its EOF: not a request to serve

        def finish(self) -> None:
            self.deadline.cancel()
            super().finish()

        def _reply(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _route(self, prefix: str) -> Optional[list[str]]:
            """The path's names after `prefix` when the request may proceed (token, names checked), else None
            (and the error is sent)."""
            if not receiver.authorized(self.headers.get("Authorization")):
                self._reply(401, {"error": "missing or wrong token"})
                return None
            if not self.server.admit(self.request, self.client_address[0]):
                self._reply(503, {"error": f"{MAX_CONNECTIONS} requests are being served: try again"})
                return None
            self.close_connection = True  # one request a connection: `admit` counts each connection once
            try:  # the body has a deadline of its own, cancelled once it is in (the work after it has none)
                body = min(max(0, int(self.headers.get("Content-Length", "0"))), receiver.max_file_bytes)
            except ValueError:
                body = 0  # refused by `_length`
            self.deadline = _Deadline(self.connection, REQUEST_TIMEOUT_S + body / MIN_BODY_BYTES_PER_S)
            if not self.path.startswith(prefix):
                self._reply(404, {"error": f"no such endpoint {self.path}"})
                return None
            names = self.path[len(prefix) :].split("/")
            if not all(_NAME.match(name) for name in names):
                self._reply(400, {"error": f"bad name in {self.path}"})
                return None
            return names

        def _length(self, limit: int) -> Optional[int]:
            """The request's Content-Length when 0 <= n <= limit, else None (and the error is sent)."""
            try:
                length = int(self.headers.get("Content-Length", ""))
            except ValueError:
                self._reply(411, {"error": "a Content-Length is required"})
                return None
            if not 0 <= length <= limit:
                self._reply(413, {"error": f"Content-Length {length} is outside 0..{limit}"})
                return None
            return length

        def do_PUT(self) -> None:
            names = self._route("/files/")
            if names is None:
                return
            if len(names) != 2:
                self._reply(404, {"error": "PUT /files/<tag>/<name>"})
                return
            tag, name = names
            length = self._length(receiver.max_file_bytes)
            if length is None:
                return
            if not receiver.reserve(length):
                self._reply(507, {"error": f"{name}: the receiver's {receiver.max_total_bytes} bytes are used"})
                return
            try:
                status, answer = self._receive(tag, name, length)
            finally:
                receiver.release(length)  # landed (now among the bytes stored) or removed
            self._reply(status, answer)

        def _receive(self, tag: str, name: str, remaining: int) -> tuple[int, dict[str, Any]]:
            """PUT's body, its digest checked, into `tag`'s staging folder as `name` (its bytes are reserved); the
            answer. It arrives in a partial file of its own beside the staging folders, not in one: a commit moves
            a staging folder whole, and must never take a file still being written."""
            expected = self.headers.get("X-Content-SHA256", "")
            staging = receiver.open_staging(tag)
            if staging is None:
                return 507, {"error": f"{MAX_STAGING} uploads are staged already: commit or delete some"}
            if not _no_links_under(staging, receiver.root):
                return 400, {"error": f"{staging.name} is not a directory of the receiver's own"}
            digest = hashlib.sha256()
            handle, partial_name = tempfile.mkstemp(dir=receiver.root, prefix=f"{PARTIAL_PREFIX}{tag}-", suffix=".part")
            partial = Path(partial_name)
            try:
                with os.fdopen(handle, "wb") as handle:
                    while remaining > 0:
                        chunk = self.rfile.read(min(_CHUNK, remaining))
                        if not chunk:
                            break
                        digest.update(chunk)
                        handle.write(chunk)
                        remaining -= len(chunk)
            except OSError:  # the connection broke or stalled past the timeout: leave nothing behind
                partial.unlink(missing_ok=True)
                raise
            self.deadline.cancel()  # the body is in: checking and landing it are the receiver's own time
            if remaining > 0 or not hmac.compare_digest(digest.hexdigest(), expected):
                partial.unlink(missing_ok=True)
                return 400, {"error": f"{name}: the bytes received do not match their SHA-256"}
            with receiver.commit_lock:  # not between a commit's digest check and its rename
                if not staging.is_dir() or staging.is_symlink():  # committed or deleted during the upload
                    partial.unlink(missing_ok=True)
                    return 409, {"error": f"{name}: version {tag} was committed or deleted during the upload"}
                if (staging / name).is_symlink():
                    partial.unlink(missing_ok=True)
                    return 400, {"error": f"{name} is a symbolic link in the staging folder"}
                os.replace(partial, staging / name)
                receiver.verified[staging / name] = expected
            return 200, {"sha256": expected}

        def do_POST(self) -> None:
            names = self._route("/commit/")
            if names is None:
                return
            (tag,) = names if len(names) == 1 else (None,)
            if tag is None:
                self._reply(404, {"error": "POST /commit/<tag>"})
                return
            length = self._length(MAX_COMMIT_BYTES)
            if length is None:
                return
            try:
                body = self.rfile.read(length)
                self.deadline.cancel()  # the body is in: the commit's work is the receiver's own time
                expected = json.loads(body or b"{}")["files"]
                assert isinstance(expected, dict) and all(isinstance(v, str) for v in expected.values())
            except (ValueError, KeyError, TypeError, AssertionError):
                self._reply(400, {"error": 'a commit is {"files": {name: sha256}}'})
                return
            with receiver.commit_lock:
                staging = receiver.staging(tag)
                if staging.is_symlink() or not staging.is_dir():
                    self._reply(409, {"error": f"version {tag} has no files"})
                    return
                files = list(staging.iterdir())  # a PUT still arriving writes outside, into its own partial file
                if any(p.is_symlink() or not p.is_file() for p in files):
                    self._reply(409, {"error": f"version {tag} holds something other than files"})
                    return
                present = {p.name for p in files}
                digests = {n: receiver.verified.pop(staging / n, None) or sha256_of(staging / n) for n in present}
                if present != set(expected) or any(digests[n] != h for n, h in expected.items()):
                    self._reply(409, {"error": f"version {tag} is incomplete or differs: {sorted(present)}"})
                    return
                earlier = receiver.versions(tag)
                found = [int(_version_of(tag).match(p.name).group(1)) for p in earlier]
                number = receiver.next_number(found)
                target = receiver.root / f"{tag}.{number}"  # a new name: nothing committed is written again
                os.rename(staging, target)
                for old in earlier:  # superseded: the trainer reloads from the path answered to its last commit
                    shutil.rmtree(old, ignore_errors=True)
            self._reply(200, {"path": str(target.resolve())})

        def do_DELETE(self) -> None:
            names = self._route("/files/")
            if names is None:
                return
            with receiver.commit_lock:
                for directory in (*receiver.versions(names[0]), receiver.staging(names[0])):
                    if directory.is_symlink():
                        directory.unlink()
                    else:
                        shutil.rmtree(directory, ignore_errors=True)
                receiver.forget_digests(receiver.staging(names[0]))
            self._reply(200, {"deleted": names[0]})

        def log_message(self, *args: Any) -> None:
            pass

    return Handler


# -- the uploader, on the trainer -------------------------------------------------------------------------------------
class WeightUploader:
    """Uploads a directory of weight files to the receiver at `url`; every request has `timeout_s` and up to
    `max_retries` retries (a digest mismatch is retried too: the bytes were damaged on the way)."""

    def __init__(self, url: str, timeout_s: float, max_retries: int) -> None:
        self.url, self.timeout_s, self.max_retries = url.rstrip("/"), timeout_s, max_retries
        token = os.environ.get(TOKEN_ENV)
        # Sent by `open_within`: no proxy from the environment, and no redirect, which would send the token to
        # another host (`lit_rl.net`).
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}

    def upload(self, directory: str | Path, tag: str) -> str:
        """Send every file of `directory` as version `tag` (up to `UPLOAD_STREAMS` at once: hashing and sending
        release the GIL), commit it; the path the receiver stored it at."""
        files = {path.name: path for path in sorted(Path(directory).iterdir()) if path.is_file()}

        def send(name: str) -> str:
            digest = sha256_of(files[name])
            headers = {"X-Content-SHA256": digest, "Content-Length": str(files[name].stat().st_size)}
            self._request("PUT", f"/files/{tag}/{name}", files[name], headers)
            return digest

        with ThreadPoolExecutor(max_workers=max(1, min(UPLOAD_STREAMS, len(files)))) as pool:
            digests = dict(zip(files, pool.map(send, files)))
        body = json.dumps({"files": digests}).encode()
        return self._request("POST", f"/commit/{tag}", body, {"Content-Type": "application/json"})["path"]

    def delete(self, tag: str) -> None:
        self._request("DELETE", f"/files/{tag}", None, {})

    def _request(self, method: str, path: str, body: Any, headers: dict[str, str]) -> dict[str, Any]:
        problem = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(0.5 * 2 ** (attempt - 1))
            data = open(body, "rb") if isinstance(body, Path) else body
            request = urllib.request.Request(
                self.url + path, data=data, method=method, headers={**self.headers, **headers}
            )
            deadline = time.monotonic() + self.timeout_s  # for the whole answer, error answers included
            try:
                with open_within(request, self.timeout_s, deadline) as response:
                    return json.loads(read_answer(response, MAX_COMMIT_BYTES, deadline) or b"{}")
            except urllib.error.HTTPError as err:
                problem = f"HTTP {err.code}: {_error_text(err, deadline)}"
                if err.code in (401, 404, 409, 413) or 300 <= err.code < 400:
                    break  # refused, or sent elsewhere: retrying would not change it
            except AnswerTooLarge as err:
                problem = f"answered too much ({err})"
                break
            except (urllib.error.URLError, http.client.HTTPException, TimeoutError, ConnectionError, OSError) as err:
                reason = getattr(err, "reason", err)
                problem = "timed out" if "timed out" in str(reason) else f"unreachable ({reason})"
            finally:
                if isinstance(body, Path):
                    data.close()
        raise WeightTransferError(
            f"weight upload to {self.url}: {method} {path} failed: {problem} (timeout {self.timeout_s:g} s); "
            "the server keeps the weights it had"
        )


def _error_text(err: urllib.error.HTTPError, deadline: float) -> str:
    """The receiver's `error` in an error answer (its first `MAX_ERROR_BYTES`, read by `deadline`), on one line."""
    try:
        return one_line(json.loads(error_answer(err, deadline)).get("error", ""), 300)
    except (ValueError, AttributeError):
        return ""


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True, help="where versions are stored (the server reloads from here)")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1: this machine)")
    parser.add_argument("--port", type=int, default=8010)
    parser.add_argument("--max-file-gib", type=float, default=64.0, help="the largest file accepted (GiB)")
    parser.add_argument("--max-total-gib", type=float, default=256.0, help="the most bytes kept under --dir (GiB)")
    args = parser.parse_args(argv)
    try:
        receiver = WeightReceiver(
            args.dir,
            args.host,
            args.port,
            max_file_bytes=int(args.max_file_gib * GIB),
            max_total_bytes=int(args.max_total_gib * GIB),
        )
    except LitRLError as err:
        sys.stderr.write(f"lit-rl weight receiver: error: {err}\n")
        sys.exit(1)
    print(f"lit-rl weight receiver on {receiver.url}, storing in {receiver.root}", flush=True)
    if receiver.generated_token:
        print(
            f"it accepts uploads with this token only; on the trainer: export {TOKEN_ENV}={receiver.generated_token}",
            flush=True,
        )
    try:
        receiver.serve_forever()
    except KeyboardInterrupt:
        receiver.stop()


if __name__ == "__main__":
    main()
