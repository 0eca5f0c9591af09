"""A stdlib HTTP server in a thread that plays a vLLM server, for the server engine's tests without vLLM."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest


class FakeServer:
    """Answers each request with the next scripted (status, body, delay_s); the last one repeats. A callable body
    is called with (path, request body) and returns the body, or (status, body)."""

    def __init__(self, script):
        self.script = list(script)
        self.requests: list[tuple[str, str, object]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                outer.requests.append((self.command, self.path, body))
                status, payload, delay = outer.script.pop(0) if len(outer.script) > 1 else outer.script[0]
                if callable(payload):
                    payload = payload(self.path, body)
                    if isinstance(payload, tuple):  # (status, body): the answer picks its own status
                        status, payload = payload
                time.sleep(delay)
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.handle_error = lambda request, address: None  # a client that gave up (timeout tests) is expected
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake_server():
    servers = []

    def start(*script):
        servers.append(FakeServer(script))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def completions_answer(path, body):
    """A vLLM-like answer: completion i of a request is [seed % 7 + 10 + i, 2 (EOS)], or 3 tokens without EOS."""
    if path == "/v1/models":
        return {"data": [{"id": "policy"}]}
    if path != "/v1/completions":
        return {}
    if body["n"] > 1 and body["temperature"] == 0.0:  # vLLM's rule
        return 400, {"error": {"message": f"n must be 1 when using greedy sampling, got {body['n']}."}}
    choices = []
    for i in range(body["n"]):
        ids = [body["seed"] % 7 + 10 + i, 2] if body["prompt"][-1] != 99 else [5, 6, 7]
        choices.append({"index": i, "token_ids": ids, "logprobs": {"token_logprobs": [-0.5] * len(ids)}})
    return {"choices": choices[::-1]}  # out of order: the engine sorts by index
