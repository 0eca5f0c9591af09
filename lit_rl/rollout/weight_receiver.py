"""Weights for a vLLM server on another machine, over HTTP: a receiver beside the server, and the trainer's uploader.

The vLLM server engine has the server reload the policy from a directory (`reload_weights`). When the server shares
the trainer's machine that directory is written in place (`model.vllm.weight_sync_dir`, `/dev/shm` by default);
otherwise a receiver runs next to the server and the trainer uploads the files to it
(`model.vllm.weight_transfer: http`, `model.vllm.weights_url`):

    python -m lit_rl.rollout.weight_receiver --dir /dev/shm/lit-rl-weights --port 8010   # on the server's machine

An upload of version `tag` sends each file with `PUT /files/<tag>/<name>` and its SHA-256 (`X-Content-SHA256`),
into a staging directory (up to 4 files at once); the receiver checks every file's digest as it arrives.
`POST /commit/<tag>` with the expected `{name: sha256}` then checks the set is complete, with the digests checked
on arrival (it hashes again only a file it has no record of, after a restart), and moves the staging directory to
`<dir>/<tag>` in one rename, and answers that path, which the trainer hands to the server's reload. A transfer
that fails (a timeout, a digest that does not match, a lost connection) never reaches the commit: the server keeps
serving the weights it has, and the trainer stops with one line naming the URL. `DELETE /files/<tag>` removes an
old version.

The receiver binds to 127.0.0.1 unless told otherwise (`--host`); set `LIT_RL_RECEIVER_TOKEN` on both sides to require
`Authorization: Bearer <token>`. Names are checked: nothing is written outside `--dir`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Optional

from lit_rl.errors import LitRLError

TOKEN_ENV = "LIT_RL_RECEIVER_TOKEN"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_CHUNK = 1 << 20
UPLOAD_STREAMS = 4  # files sent at once


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
    """Serves uploads into `root` on `host:port` (0: a free port) until `stop`."""

    def __init__(self, root: str | Path, host: str = "127.0.0.1", port: int = 0, token: Optional[str] = None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.token = token if token is not None else os.environ.get(TOKEN_ENV)
        self.server = ThreadingHTTPServer((host, port), _handler(self))
        self.url = f"http://{host}:{self.server.server_port}"
        self.verified: dict[Path, str] = {}  # staged file -> the SHA-256 checked as it arrived (commit trusts it)

    def serve_forever(self) -> None:
        self.server.serve_forever()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def staging(self, tag: str) -> Path:
        return self.root / f".incoming-{tag}"


def _handler(receiver: WeightReceiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
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
            if receiver.token and self.headers.get("Authorization") != f"Bearer {receiver.token}":
                self._reply(401, {"error": "missing or wrong token"})
                return None
            if not self.path.startswith(prefix):
                self._reply(404, {"error": f"no such endpoint {self.path}"})
                return None
            names = self.path[len(prefix) :].split("/")
            if not all(_NAME.match(name) for name in names):
                self._reply(400, {"error": f"bad name in {self.path}"})
                return None
            return names

        def do_PUT(self) -> None:
            names = self._route("/files/")
            if names is None:
                return
            if len(names) != 2:
                self._reply(404, {"error": "PUT /files/<tag>/<name>"})
                return
            tag, name = names
            expected = self.headers.get("X-Content-SHA256", "")
            remaining = int(self.headers.get("Content-Length", "0"))
            staging = receiver.staging(tag)
            staging.mkdir(parents=True, exist_ok=True)
            digest = hashlib.sha256()
            # Its own partial file: a retried PUT of the same name may overlap this one.
            handle, partial_name = tempfile.mkstemp(dir=staging, prefix=f".{name}.", suffix=".part")
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
            except OSError:  # the connection broke: leave nothing behind
                partial.unlink(missing_ok=True)
                raise
            if remaining > 0 or digest.hexdigest() != expected:
                partial.unlink(missing_ok=True)
                self._reply(400, {"error": f"{name}: the bytes received do not match their SHA-256"})
                return
            os.replace(partial, staging / name)
            receiver.verified[staging / name] = expected
            self._reply(200, {"sha256": expected})

        def do_POST(self) -> None:
            names = self._route("/commit/")
            if names is None:
                return
            (tag,) = names if len(names) == 1 else (None,)
            if tag is None:
                self._reply(404, {"error": "POST /commit/<tag>"})
                return
            expected = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))) or b"{}")["files"]
            staging = receiver.staging(tag)
            files = staging.iterdir() if staging.is_dir() else ()
            present = {p.name for p in files if not p.name.endswith(".part")}  # not a PUT still (or never) arriving
            digests = {n: receiver.verified.pop(staging / n, None) or sha256_of(staging / n) for n in present}
            if present != set(expected) or any(digests[n] != h for n, h in expected.items()):
                self._reply(409, {"error": f"version {tag} is incomplete or differs: {sorted(present)}"})
                return
            target = receiver.root / tag
            shutil.rmtree(target, ignore_errors=True)
            os.rename(staging, target)
            self._reply(200, {"path": str(target.resolve())})

        def do_DELETE(self) -> None:
            names = self._route("/files/")
            if names is None:
                return
            for directory in (receiver.root / names[0], receiver.staging(names[0])):
                shutil.rmtree(directory, ignore_errors=True)
            for path in [p for p in list(receiver.verified) if p.parent == receiver.staging(names[0])]:
                receiver.verified.pop(path, None)
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
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

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
            try:
                with self._opener.open(request, timeout=self.timeout_s) as response:
                    return json.loads(response.read() or b"{}")
            except urllib.error.HTTPError as err:
                problem = f"HTTP {err.code}: {_error_text(err)}"
                if err.code in (401, 404, 409):
                    break  # refused as asked: retrying would not change it
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as err:
                reason = getattr(err, "reason", err)
                problem = "timed out" if "timed out" in str(reason) else f"unreachable ({reason})"
            finally:
                if isinstance(body, Path):
                    data.close()
        raise WeightTransferError(
            f"weight upload to {self.url}: {method} {path} failed: {problem} (timeout {self.timeout_s:g} s); "
            "the server keeps the weights it had"
        )


def _error_text(err: urllib.error.HTTPError) -> str:
    try:
        return json.loads(err.read()).get("error", "")
    except (ValueError, AttributeError):
        return ""


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True, help="where versions are stored (the server reloads from here)")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1: this machine)")
    parser.add_argument("--port", type=int, default=8010)
    args = parser.parse_args(argv)
    receiver = WeightReceiver(args.dir, args.host, args.port)
    print(f"lit-rl weight receiver on {receiver.url}, storing in {receiver.root}", flush=True)
    try:
        receiver.serve_forever()
    except KeyboardInterrupt:
        receiver.stop()


if __name__ == "__main__":
    main()
