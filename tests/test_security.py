"""What lit-rl loads from files it did not make: a checkpoint given to `lit_rl.export` is read as tensors and
plain containers only (a crafted one runs no code), and it cannot grant itself `trust_remote_code`. (A checkpoint
given to `--ckpt_path` configures nothing: tests/integration/test_checkpoint_overrides.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lit_rl.errors import LitRLError
from lit_rl.export import export_checkpoint
from tests.conftest import cli_env, listening_addresses

# Unpickling this object runs `touch <marker>`: what `torch.load(weights_only=False)` would do.
CRAFTED = """
import os, sys, torch
class Payload:
    def __reduce__(self):
        return (os.system, ("touch " + sys.argv[2],))
torch.save({"state_dict": {}, "hyper_parameters": {"model_name_or_path": "lit-rl/tiny-qwen2-base"},
            "payload": Payload()}, sys.argv[1])
"""


def test_export_of_a_crafted_checkpoint_runs_no_code_and_says_so_in_one_line(tmp_path):
    checkpoint, marker = tmp_path / "shared.ckpt", tmp_path / "code_ran"
    subprocess.run([sys.executable, "-c", CRAFTED, str(checkpoint), str(marker)], check=True, timeout=120)
    result = subprocess.run(
        [sys.executable, "-m", "lit_rl.export", str(checkpoint), str(tmp_path / "out")],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1
    assert result.stderr == (
        f"lit-rl export: error: checkpoint {checkpoint} holds objects other than tensors and plain containers "
        "(posix.system), which lit-rl does not unpickle: it may run code\n"
    )
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_cannot_grant_itself_remote_code(tmp_path):
    checkpoint = tmp_path / "remote.ckpt"
    hyper_parameters = {"model_name_or_path": "someone/model-with-code", "trust_remote_code": True}
    torch.save({"state_dict": {"policy.w": torch.zeros(1)}, "hyper_parameters": hyper_parameters}, checkpoint)
    with pytest.raises(LitRLError) as refused:
        export_checkpoint(checkpoint, tmp_path / "out")
    assert str(refused.value) == (
        f"checkpoint {checkpoint} was trained with trust_remote_code: loading it runs code from "
        "'someone/model-with-code'; name each repository you trust (--trust-remote-code someone/model-with-code)"
    )


def test_export_trusts_only_the_repositories_named_a_ppo_critics_own_included(tmp_path):
    """The review's finding: trusting the policy's repository also ran the code of the critic's, never named. Now the
    refusal names both, and trusting one leaves the other refused; the command line takes them one flag each."""
    checkpoint = tmp_path / "ppo.ckpt"
    hyper_parameters = {
        "model_name_or_path": "someone/policy-with-code",
        "trust_remote_code": True,
        "critic_model_name_or_path": "stranger/critic-with-code",
    }
    state = {"policy.w": torch.zeros(1), "critic.w": torch.zeros(1)}
    torch.save({"state_dict": state, "hyper_parameters": hyper_parameters}, checkpoint)
    with pytest.raises(LitRLError) as refused:
        export_checkpoint(checkpoint, tmp_path / "out", trust_remote_code=["someone/policy-with-code"])
    assert str(refused.value) == (
        f"checkpoint {checkpoint} was trained with trust_remote_code: loading it runs code from "
        "'someone/policy-with-code', 'stranger/critic-with-code'; name each repository you trust "
        "(--trust-remote-code stranger/critic-with-code)"
    )
    result = subprocess.run(
        [sys.executable, "-m", "lit_rl.export", str(checkpoint), str(tmp_path / "out")]
        + ["--trust-remote-code", "someone/policy-with-code"],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1 and result.stderr == f"lit-rl export: error: {refused.value}\n"
    assert not (tmp_path / "out").exists()


# -- the weight receiver: what the review did to it, on loopback --------------------------------------------------
def _serve(receiver):
    import threading

    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    return receiver


def _http(url: str, method: str, path: str, body: bytes = b"", headers: dict | None = None) -> int:
    import http.client
    from urllib.parse import urlparse

    parsed = urlparse(url)
    connection = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=10)
    try:
        connection.putrequest(method, path)
        for key, value in (headers or {}).items():
            connection.putheader(key, value)
        connection.endheaders()
        if body:
            connection.send(body)
        return connection.getresponse().status
    except (ConnectionError, OSError):
        return -1  # the receiver closed the connection
    finally:
        connection.close()


def _weights(directory):
    directory.mkdir()
    (directory / "model-00000.safetensors").write_bytes(b"trained weights" * 100)
    return directory


def test_a_committed_version_is_never_replaced_and_an_outsider_needs_the_token(tmp_path, monkeypatch):
    """The attack: after the trainer committed `current`, a PUT and a commit of `current` by someone without the
    token. With a token they are refused; without one (loopback) their commit gets a new name, and the path the
    trainer was answered never holds their bytes (the superseded version is removed)."""
    import hashlib
    import json

    from lit_rl.rollout.server.weight_receiver import WeightReceiver, WeightUploader, sha256_of

    evil = b"attacker weights"
    digest = hashlib.sha256(evil).hexdigest()
    commit = json.dumps({"files": {"model-00000.safetensors": digest}}).encode()
    length = {"Content-Length": str(len(evil)), "X-Content-SHA256": digest}
    local = _weights(tmp_path / "local")

    guarded = _serve(WeightReceiver(tmp_path / "guarded", token="s3cret"))
    monkeypatch.setenv("LIT_RL_RECEIVER_TOKEN", "s3cret")
    trained = WeightUploader(guarded.url, timeout_s=5, max_retries=0).upload(local, "current")
    assert _http(guarded.url, "PUT", "/files/current/model-00000.safetensors", evil, length) == 401
    assert _http(guarded.url, "POST", "/commit/current", commit, {"Content-Length": str(len(commit))}) == 401
    wrong = {"Authorization": "Bearer s3creT", "Content-Length": str(len(commit))}
    assert _http(guarded.url, "POST", "/commit/current", commit, wrong) == 401
    assert sha256_of(f"{trained}/model-00000.safetensors") == sha256_of(local / "model-00000.safetensors")
    guarded.stop()

    monkeypatch.delenv("LIT_RL_RECEIVER_TOKEN")
    open_receiver = _serve(WeightReceiver(tmp_path / "open"))  # loopback without a token: anyone on this machine
    trained = WeightUploader(open_receiver.url, timeout_s=5, max_retries=0).upload(local, "current")
    assert _http(open_receiver.url, "PUT", "/files/current/model-00000.safetensors", evil, length) == 200
    assert _http(open_receiver.url, "POST", "/commit/current", commit, {"Content-Length": str(len(commit))}) == 200
    # The outsider's commit is a new name; the path the trainer was answered (and hands to the server's reload)
    # never holds the outsider's bytes: the new commit superseded it, so it is gone (a reload of it finds no files).
    assert trained.endswith("current.1")
    assert not Path(trained).exists()
    assert [p.name for p in (tmp_path / "open").iterdir() if p.name.startswith("current")] == ["current.2"]
    assert sha256_of(tmp_path / "open" / "current.2" / "model-00000.safetensors") == digest
    # A DELETE of the tag, then commits again: numbers are never given twice, so none lands at the trainer's path
    # (they counted from 1 again: the outsider's first commit after the DELETE was the trainer's `current.1`).
    assert _http(open_receiver.url, "DELETE", "/files/current") == 200
    assert _http(open_receiver.url, "PUT", "/files/current/model-00000.safetensors", evil, length) == 200
    assert _http(open_receiver.url, "POST", "/commit/current", commit, {"Content-Length": str(len(commit))}) == 200
    assert not Path(trained).exists()
    assert [p.name for p in (tmp_path / "open").iterdir() if p.name.startswith("current")] == ["current.3"]
    open_receiver.stop()
    # Nor past a restart of the receiver on the same directory: a DELETE there, then a commit, is `current.4`.
    restarted = _serve(WeightReceiver(tmp_path / "open"))
    assert _http(restarted.url, "DELETE", "/files/current") == 200
    assert _http(restarted.url, "PUT", "/files/current/model-00000.safetensors", evil, length) == 200
    assert _http(restarted.url, "POST", "/commit/current", commit, {"Content-Length": str(len(commit))}) == 200
    assert [p.name for p in (tmp_path / "open").iterdir() if p.name.startswith("current")] == ["current.4"]
    restarted.stop()


def test_a_file_lands_only_between_commits_never_between_a_commits_check_and_its_rename(tmp_path):
    """The review's finding 3: PUT replaced its file without the commit lock, so bytes could land between a commit's
    digest check and its rename. Held by a commit, the lock now keeps a finished PUT's file out of the staging
    folder until the commit is done; the PUT then finds its version committed and says so (409)."""
    import hashlib
    import threading
    import time

    from lit_rl.rollout.server.weight_receiver import WeightReceiver

    receiver = _serve(WeightReceiver(tmp_path / "w"))
    body = b"late bytes"
    headers = {"Content-Length": str(len(body)), "X-Content-SHA256": hashlib.sha256(body).hexdigest()}
    staged = tmp_path / "w" / ".incoming-v1" / "model-00000.safetensors"
    statuses = []
    try:
        with receiver.commit_lock:  # as a commit holds it from its check to its rename
            put = threading.Thread(
                target=lambda: statuses.append(
                    _http(receiver.url, "PUT", "/files/v1/model-00000.safetensors", body, headers)
                )
            )
            put.start()
            deadline = time.monotonic() + 10
            while not list((tmp_path / "w").glob(".part-v1-*")) and time.monotonic() < deadline:
                time.sleep(0.05)  # its partial file is there
            time.sleep(0.5)  # and its 10 bytes, on loopback
            assert not staged.exists() and not statuses  # it waits for the commit
            (tmp_path / "w" / ".incoming-v1").rename(tmp_path / "w" / "v1.1")  # the commit's rename
        put.join(timeout=10)
        assert statuses == [409] and not staged.exists()
    finally:
        receiver.stop()


def test_uploads_at_once_reserve_their_bytes_and_staging_folders_are_capped(tmp_path, monkeypatch):
    """The review's finding 4: the byte limit was checked without a reservation (parallel uploads all passed it),
    and empty PUTs made staging folders without limit. An upload under way now holds its bytes against the limit,
    and at most `MAX_STAGING` staging folders exist at once."""
    import hashlib
    import os
    import socket
    import time

    import lit_rl.rollout.server.weight_receiver as module

    monkeypatch.setattr(module, "MAX_STAGING", 3)
    receiver = _serve(module.WeightReceiver(tmp_path / "w", max_total_bytes=1000))
    host, port = receiver.server.server_address[:2]
    body = b"x" * 600
    headers = {"Content-Length": "600", "X-Content-SHA256": hashlib.sha256(body).hexdigest()}
    slow = socket.create_connection((host, port))
    try:  # an upload of 600 bytes under way: 10 sent
        slow.sendall(
            b"PUT /files/a/model-00000.safetensors HTTP/1.1\r\nContent-Length: 600\r\n"
            b"X-Content-SHA256: " + headers["X-Content-SHA256"].encode() + b"\r\n\r\n" + body[:10]
        )
        deadline = time.monotonic() + 10
        while not list((tmp_path / "w").glob(".part-a-*")) and time.monotonic() < deadline:
            time.sleep(0.05)  # accepted: its bytes are reserved, its partial file made
        assert _http(receiver.url, "PUT", "/files/b/model-00000.safetensors", body, headers) == 507  # 600 + 600
        slow.sendall(body[10:])
        assert b" 200 " in slow.recv(1024)
    finally:
        slow.close()
    empty = {"Content-Length": "0", "X-Content-SHA256": hashlib.sha256(b"").hexdigest()}
    assert [_http(receiver.url, "PUT", f"/files/e{i}/x", b"", empty) for i in range(3)] == [200, 200, 507]
    # A staging folder untouched for STALE_STAGING_S is swept by a later upload, not only at the next start.
    monkeypatch.setattr(module, "STALE_SWEEP_S", 0.0)
    hour_ago = time.time() - module.STALE_STAGING_S - 1
    for path in (tmp_path / "w" / ".incoming-e0" / "x", tmp_path / "w" / ".incoming-e0"):  # it, and what it holds
        os.utime(path, (hour_ago, hour_ago))
    assert _http(receiver.url, "PUT", "/files/e2/x", b"", empty) == 200
    assert sorted(p.name for p in (tmp_path / "w").glob(".incoming-*")) == [
        ".incoming-a",
        ".incoming-e1",
        ".incoming-e2",
    ]
    receiver.stop()


def test_a_receiver_on_another_interface_makes_a_token_when_given_none(tmp_path, monkeypatch):
    from lit_rl.rollout.server.weight_receiver import WeightReceiver

    monkeypatch.delenv("LIT_RL_RECEIVER_TOKEN", raising=False)
    receiver = WeightReceiver(tmp_path / "w", host="0.0.0.0")
    try:
        assert receiver.generated_token and len(receiver.generated_token) >= 32
        assert not receiver.authorized(None) and receiver.authorized(f"Bearer {receiver.generated_token}")
    finally:
        receiver.server.server_close()
    loopback = WeightReceiver(tmp_path / "l")
    assert loopback.generated_token is None and loopback.authorized(None)
    loopback.server.server_close()


def test_bad_lengths_and_bodies_are_refused_before_anything_is_read(tmp_path):
    from lit_rl.rollout.server.weight_receiver import WeightReceiver

    receiver = _serve(WeightReceiver(tmp_path / "w", max_file_bytes=1000, max_total_bytes=5000))
    try:
        put = "/files/v1/model-00000.safetensors"
        assert _http(receiver.url, "POST", "/commit/v1", b"x" * 100, {"Content-Length": "-1"}) == 413
        assert _http(receiver.url, "POST", "/commit/v1", b"", {"Content-Length": str(2 << 20)}) == 413
        assert _http(receiver.url, "PUT", put, b"", {"Content-Length": "-5", "X-Content-SHA256": "0"}) == 413
        assert _http(receiver.url, "PUT", put, b"", {"Content-Length": "1001", "X-Content-SHA256": "0"}) == 413
        assert _http(receiver.url, "PUT", put, b"", {"X-Content-SHA256": "0"}) == 411
        bad_commit = b'{"files": ["not", "a", "map"]}'
        assert _http(receiver.url, "POST", "/commit/v1", bad_commit, {"Content-Length": str(len(bad_commit))}) == 400
        (tmp_path / "w" / "filler").write_bytes(b"0" * 4500)  # the quota: 4500 of 5000 bytes used
        assert _http(receiver.url, "PUT", put, b"", {"Content-Length": "600", "X-Content-SHA256": "0"}) == 507
    finally:
        receiver.stop()


def test_stalled_connections_are_dropped_with_their_partial_files_and_capped(tmp_path, monkeypatch):
    import socket
    import time

    import lit_rl.rollout.server.weight_receiver as module

    monkeypatch.setattr(module, "MAX_CONNECTIONS", 3)
    receiver = module.WeightReceiver(tmp_path / "w")
    receiver.server.RequestHandlerClass.timeout = 1.0
    _serve(receiver)
    host, port = receiver.server.server_address[:2]
    stalled = []
    try:
        for _ in range(3):  # each sends its headers and 10 of 1000 bytes, then nothing
            client = socket.create_connection((host, port))
            client.sendall(
                b"PUT /files/v1/model-00000.safetensors HTTP/1.1\r\nContent-Length: 1000\r\n"
                b"X-Content-SHA256: 00\r\n\r\n" + b"x" * 10
            )
            stalled.append(client)
        time.sleep(0.3)
        assert _http(receiver.url, "DELETE", "/files/v9") == 503  # a fourth connection, while 3 are held
        deadline = time.monotonic() + 10
        while list((tmp_path / "w").glob(".part-v1-*")) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not list((tmp_path / "w").glob(".part-v1-*"))  # dropped after the timeout, partial files removed
        assert _http(receiver.url, "DELETE", "/files/v9") == 200  # the slots are free again
    finally:
        for client in stalled:
            client.close()
        receiver.stop()


def _cut_after(client, trickle: bytes, limit_s: float) -> float:
    """Send `trickle` a byte every 0.1 s (no read of the server's ever waits long) until the server cuts the
    connection, for at most `limit_s`: when it was cut (`time.monotonic()`)."""
    import socket
    import time

    client.settimeout(0.1)
    for byte in (trickle * 1000)[: int(limit_s / 0.1)]:
        try:
            client.sendall(bytes([byte]))
            if client.recv(1000) == b"":
                break  # the server shut the connection
        except socket.timeout:
            continue  # still open, nothing said
        except OSError:
            break  # reset
    return time.monotonic()


def test_an_outsider_trickling_requests_cannot_hold_the_trainers_slots(tmp_path, monkeypatch):
    """Connections wait for their head and token in a pool of their own, a few per address and each for a bounded
    time however slowly their bytes come; a served request has a deadline for its body: an outsider sending a byte
    at a time holds no slot the trainer needs, and is cut."""
    import socket
    import time

    import lit_rl.rollout.server.weight_receiver as module

    monkeypatch.setattr(module, "MAX_WAITING_PER_PEER", 3)
    monkeypatch.setattr(module, "MAX_CONNECTIONS", 3)  # as many as the outsider opens: it must take none of them
    monkeypatch.setattr(module, "HEAD_DEADLINE_S", 1.0)
    monkeypatch.setattr(module, "REQUEST_TIMEOUT_S", 1.0)  # the served request's base deadline
    receiver = module.WeightReceiver(tmp_path / "w", token="secret")
    receiver.server.RequestHandlerClass.timeout = 30.0  # each read's own limit: far from the deadlines under test
    _serve(receiver)
    host, port = receiver.server.server_address[:2]
    trainer = {"Authorization": "Bearer secret"}
    outsider = []
    try:
        opened = time.monotonic()
        for _ in range(3):  # from another address: a request line, and the headers never finished
            try:
                client = socket.create_connection((host, port), source_address=("127.0.0.2", 0))
            except OSError:  # 127.0.0.2 is loopback on Linux, not everywhere
                pytest.skip("this system cannot connect from a second loopback address")
            client.sendall(b"PUT /files/v1/model.safetensors HTTP/1.1\r\nContent-Length: 10")
            outsider.append(client)
        fourth = socket.create_connection((host, port), source_address=("127.0.0.2", 0), timeout=5)
        outsider.append(fourth)
        assert fourth.recv(100).startswith(b"HTTP/1.1 503")  # that address holds its share of waiting slots
        assert _http(receiver.url, "DELETE", "/files/v9", headers=trainer) == 200  # the trainer is served meanwhile
        # A head still trickling in is cut at its deadline (1 s): no read's own limit (30 s) comes near.
        assert 0.9 < _cut_after(outsider[0], b"0", limit_s=10.0) - opened < 10.0
        # A served request (the token checked) whose body trickles is cut at REQUEST_TIMEOUT_S plus its length at
        # MIN_BODY_BYTES_PER_S (about 1 s here), and its partial file goes.
        body = socket.create_connection((host, port))
        outsider.append(body)
        opened = time.monotonic()
        body.sendall(
            b"PUT /files/v1/model.safetensors HTTP/1.1\r\nAuthorization: Bearer secret\r\nContent-Length: 1000\r\n"
            b"X-Content-SHA256: 00\r\n\r\n"
        )
        assert 0.9 < _cut_after(body, b"x", limit_s=10.0) - opened < 10.0
        deadline = time.monotonic() + 5
        while list((tmp_path / "w").glob(".part-v1-*")) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not list((tmp_path / "w").glob(".part-v1-*"))
        assert _http(receiver.url, "DELETE", "/files/v9") == 401  # and without the token, nothing is served
    finally:
        for client in outsider:
            client.close()
        receiver.stop()


def test_links_never_lead_writes_out_of_the_receivers_directory(tmp_path):
    import hashlib

    from lit_rl.errors import LitRLError
    from lit_rl.rollout.server.weight_receiver import WeightReceiver

    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "w"
    root.mkdir(mode=0o700)
    (root / ".incoming-v1").symlink_to(outside)  # a staging folder that points elsewhere
    receiver = _serve(WeightReceiver(root))
    try:
        data = b"ssh-ed25519 AAAA attacker"
        headers = {"Content-Length": str(len(data)), "X-Content-SHA256": hashlib.sha256(data).hexdigest()}
        assert _http(receiver.url, "PUT", "/files/v1/authorized_keys", data, headers) == 400
        assert list(outside.iterdir()) == []
    finally:
        receiver.stop()
    (tmp_path / "link").symlink_to(outside)
    with pytest.raises(LitRLError, match="is a symbolic link"):
        WeightReceiver(tmp_path / "link")
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(LitRLError, match="writable by others"):
        WeightReceiver(shared)


@pytest.mark.parametrize("problem", ["link", "writable"])
def test_a_configured_sync_dir_gets_the_receivers_checks(tmp_path, fake_server, problem):  # noqa: F811
    """`transfer.sync_dir` is what the server loads from: a link to elsewhere, or a folder others may write into,
    is refused in one line naming the key, before any weight is written."""
    from lit_rl.rollout import VLLMServer, WeightTransfer
    from lit_rl.rollout.engines.vllm_server import VLLMServerEngine
    from tests.fake_vllm import completions_answer

    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    sync_dir = tmp_path / "sync"
    if problem == "link":
        sync_dir.symlink_to(real)
        expected = f"model.rollout.engine.transfer.sync_dir {sync_dir} is a symbolic link: give the directory itself"
    else:
        sync_dir.mkdir()
        sync_dir.chmod(0o777)
        expected = f"model.rollout.engine.transfer.sync_dir {sync_dir} is writable by others: chmod 700 it"
    server = fake_server((200, completions_answer, 0))
    config = VLLMServer(server_url=server.url, max_retries=0, transfer=WeightTransfer(sync_dir=str(sync_dir)))
    with pytest.raises(LitRLError) as refused:
        VLLMServerEngine(config, eos_token_ids=[2], pad_token_id=0)
    assert str(refused.value) == expected
    assert list(real.iterdir()) == []


def test_a_weight_file_is_written_under_a_name_no_one_could_plant_a_link_at(tmp_path):
    """The old temporary name (`<file>.tmp`) was predictable: a link planted there would have sent the weights'
    bytes through it. The file is written under a fresh name, then renamed; the planted link's target is untouched."""
    from lit_rl.rollout.engines.vllm_server import _write_safetensors

    victim = tmp_path / "victim"
    victim.write_text("untouched")
    target = tmp_path / "model-00000.safetensors"
    Path(f"{target}.tmp").symlink_to(victim)
    _write_safetensors({"w": torch.ones(2)}, str(target))
    assert victim.read_text() == "untouched" and target.is_file() and not target.is_symlink()
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["model-00000.safetensors", "model-00000.safetensors.tmp", "victim"]  # no temporary file left


def test_the_uploader_follows_no_redirect_so_the_token_stays_home(tmp_path, monkeypatch):
    """A receiver address that answers 302 to another host: the upload stops there, and the other host never
    sees a request (let alone the bearer token)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from lit_rl.rollout.server.weight_receiver import WeightTransferError, WeightUploader

    seen = []

    class Elsewhere(BaseHTTPRequestHandler):
        def do_PUT(self):
            seen.append(self.headers.get("Authorization"))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    elsewhere = ThreadingHTTPServer(("127.0.0.1", 0), Elsewhere)

    class Redirecting(BaseHTTPRequestHandler):
        def do_PUT(self):
            self.send_response(307)
            self.send_header("Location", f"http://127.0.0.1:{elsewhere.server_port}{self.path}")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    redirecting = ThreadingHTTPServer(("127.0.0.1", 0), Redirecting)
    for server in (elsewhere, redirecting):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("LIT_RL_RECEIVER_TOKEN", "s3cret")
    try:
        uploader = WeightUploader(f"http://127.0.0.1:{redirecting.server_port}", timeout_s=5, max_retries=2)
        with pytest.raises(WeightTransferError, match="HTTP 307"):
            uploader.upload(_weights(tmp_path / "local"), "current")
    finally:
        for server in (elsewhere, redirecting):
            server.shutdown()
            server.server_close()
    assert seen == []


# -- clients: answers of bounded size and time ----------------------------------------------------------------------
def _misbehaving_server(answer):
    """A one-thread HTTP server on loopback that reads a request and then runs `answer(socket)`; its URL."""
    import socket
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)

    def serve():
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            with client:
                client.settimeout(10)
                request = b""
                while b"\r\n\r\n" not in request:
                    request += client.recv(65536)
                head, _, body = request.partition(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length")
                    ),
                    0,
                )
                while len(body) < length:
                    body += client.recv(65536)
                try:
                    answer(client)
                except OSError:
                    pass

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}/score", listener


def _drip_headers(client):
    """An answer whose headers come a byte every 0.2 s: http.client reads them with a timeout per receive."""
    import time

    client.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
    for _ in range(40):
        time.sleep(0.2)
        client.sendall(b"x")


def test_a_reward_server_cannot_flood_drip_or_truncate_its_answer_past_the_limits():
    import time

    from lit_rl.errors import RewardFunctionError
    from lit_rl.rewards.http import MAX_ANSWER_BYTES, HTTPReward

    def flood(client):
        client.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n")
        chunk = b" " * (1 << 20)
        for _ in range((MAX_ANSWER_BYTES >> 20) + 8):  # past the limit, without a Content-Length
            client.sendall(chunk)

    def drip(client):
        client.sendall(b'HTTP/1.1 200 OK\r\nContent-Length: 20\r\n\r\n{"rewards"')
        for _ in range(40):  # a byte every 0.2 s: each read within the socket timeout, the whole far past it
            time.sleep(0.2)
            client.sendall(b" ")

    def truncate(client):
        client.sendall(b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"rewards": [1.0')

    for answer, expected, most_s in (
        (flood, "answered too much", 30),
        (drip, "timed out", 4),
        (_drip_headers, "timed out", 4),
        (truncate, r"answered less than it announced \(the connection closed\) after 2 tries", 10),
    ):
        url, listener = _misbehaving_server(answer)
        reward = HTTPReward(url, timeout_s=1.0, max_retries=1)
        started = time.monotonic()
        with pytest.raises(RewardFunctionError, match=expected):
            reward(["1+1="], ["2"])
        assert time.monotonic() - started < most_s, answer.__name__
        listener.close()


def test_error_answers_are_read_within_the_limits_by_the_vllm_client_and_the_uploader():
    """The review's finding 5: error answers were read whole, with no deadline: a 1 s client waited out a dripping
    one, and a receiver's 32 MiB error became the error message. Now each reads the first 64 KiB before its
    deadline. Headers that drip are cut at the deadline too (a later review: they held a 1 s client 8 s)."""
    import time

    from lit_rl.rollout.server.client import RolloutServerError, VLLMServerClient
    from lit_rl.rollout.server.weight_receiver import WeightTransferError, WeightUploader

    def drip(client):
        client.sendall(b'HTTP/1.1 500 Internal Server Error\r\nContent-Length: 1000\r\n\r\n{"error": "')
        for _ in range(40):  # a byte every 0.2 s: each read within the socket timeout, the whole far past it
            time.sleep(0.2)
            client.sendall(b"x")

    def flood(client):
        message = b'{"error": "' + b"x" * (32 << 20) + b'"}'
        client.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n" % len(message) + message)

    for answer in (drip, flood, _drip_headers):
        url, listener = _misbehaving_server(answer)
        base = url.rsplit("/", 1)[0]
        started = time.monotonic()
        with pytest.raises(RolloutServerError) as failed:  # ServerDownError for the 5xx
            VLLMServerClient(base, timeout_s=1.0, max_retries=0).request("GET", "/v1/models")
        assert time.monotonic() - started < 4, answer.__name__
        assert len(str(failed.value)) < 1000 and "\n" not in str(failed.value), answer.__name__
        started = time.monotonic()
        with pytest.raises(WeightTransferError) as failed:
            WeightUploader(base, timeout_s=1.0, max_retries=0)._request("POST", "/commit/v1", b"{}", {})
        assert time.monotonic() - started < 4, answer.__name__
        assert len(str(failed.value)) < 1000 and "\n" not in str(failed.value), answer.__name__
        listener.close()


def test_the_vllm_client_sends_the_api_key_and_follows_no_redirect(monkeypatch):
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from lit_rl.rollout.server.client import RolloutServerError, VLLMServerClient, why_not_started

    seen = []

    class Server(BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append((self.path, self.headers.get("Authorization")))
            if self.path == "/moved":
                self.send_response(302)
                self.send_header("Location", "http://127.0.0.1:9/elsewhere")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            data = json.dumps({"ok": True}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Server)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("VLLM_API_KEY", "k3y")
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")  # ignored: the client talks to the server itself
    try:
        client = VLLMServerClient(f"http://127.0.0.1:{server.server_port}", timeout_s=5, max_retries=0)
        assert client.request("GET", "/health") == {"ok": True}
        with pytest.raises(RolloutServerError, match="HTTP 302"):
            client.request("GET", "/moved")
        # A server that is not vLLM's (an OpenEnv app lit-rl serves) is polled without the key.
        assert why_not_started(_Running(), f"http://127.0.0.1:{server.server_port}", 5, api_key=False) is None
    finally:
        server.shutdown()
        server.server_close()
    assert seen == [("/health", "Bearer k3y"), ("/moved", "Bearer k3y"), ("/health", None)]


class _Running:
    """A child process still running (`why_not_started` asks it), the leader of this process's session, whose
    listeners are the test's own."""

    pid = os.getsid(0)

    def poll(self):
        return None


# -- tools ------------------------------------------------------------------------------------------------------------
def test_tool_calls_are_found_as_the_lazy_pattern_finds_them_without_its_quadratic_scan():
    import random
    import re

    from lit_rl.envs.tools import ToolEnvironment

    def calc(argument):
        return argument

    def calculator(argument):
        return argument

    environment = ToolEnvironment([calc, calculator])
    pattern = re.compile(r"<(calc|calculator)>(.*?)</\1>", re.DOTALL)  # what a turn was scanned with before
    pieces = ["<calc>", "</calc>", "<calculator>", "</calculator>", "1+2", " ", "<", ">", "/", "calc"]
    generator = random.Random(0)
    for _ in range(2000):
        text = "".join(generator.choice(pieces) for _ in range(generator.randint(0, 12)))
        expected = pattern.search(text)
        assert environment.first_call(text) == (expected.groups() if expected else None), text
    # 200k characters of tags never closed (before: about 20 s), then one call at the end.
    text = "<calc>1" * 30_000 + "<calculator>7*6</calculator>"
    assert environment.first_call(text) == ("calculator", "7*6")


def test_tool_threads_past_their_limit_cannot_pile_up(monkeypatch):
    import threading

    import lit_rl.envs.runner as runner
    import lit_rl.envs.tools as tools

    monkeypatch.setattr(runner, "MAX_OVERRUNNING", 2)
    monkeypatch.setattr(runner, "tool_overrunning", runner._Overrunning())
    monkeypatch.setattr(runner, "overrunning", runner._Overrunning())
    release = threading.Event()
    ran = []

    def stuck(argument):
        ran.append(argument)
        release.wait(30)
        return "late"

    assert tools.run_tool(stuck, "a", 0.05) == ("error: timed out after 0.05 s", True)
    assert tools.run_tool(stuck, "b", 0.05) == ("error: timed out after 0.05 s", True)
    refused = tools.run_tool(stuck, "c", 0.05)
    assert refused == ("error: 2 calls are still running past their time limit; not run", True)
    assert ran == ["a", "b"] and runner.tool_overrunning.count() == 2  # the refused call never ran
    assert runner.overrunning.count() == 0  # environments' own calls are not refused for the tools' overruns
    release.set()
    deadline = time.monotonic() + 5
    while runner.tool_overrunning.count() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert runner.tool_overrunning.count() == 0
    assert tools.run_tool(lambda argument: "ok", "", 1.0) == ("ok", False)


def test_environment_steps_past_their_limit_cannot_pile_up_either(monkeypatch):
    """The runner's plain calls share the tools' cap: past `MAX_OVERRUNNING` stuck steps, a step is refused without
    running, and a stuck `async` step is cancelled, holding no thread."""
    import asyncio
    import threading

    import lit_rl.envs.runner as runner

    monkeypatch.setattr(runner, "MAX_OVERRUNNING", 2)
    monkeypatch.setattr(runner, "overrunning", runner._Overrunning())
    release = threading.Event()
    envs = runner.EnvironmentRunner(concurrency=8, timeout_s=0.05)
    ran = []

    def stuck(text):
        ran.append(text)
        release.wait(30)

    async def stuck_async(text):
        await asyncio.sleep(30)

    try:
        outcomes = envs.run([(stuck, ("a",)), (stuck, ("b",))])
        assert [str(o) for o in outcomes] == ["timed out after 0.05 s"] * 2
        refused, cancelled = envs.run([(stuck, ("c",)), (stuck_async, ("d",))])
        assert str(refused) == "2 calls are still running past their time limit; not run"
        assert str(cancelled) == "timed out after 0.05 s"
        assert sorted(ran) == ["a", "b"] and runner.overrunning.count() == 2  # "c" never ran
    finally:
        release.set()
        envs.close()
    deadline = time.monotonic() + 5
    while runner.overrunning.count() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert runner.overrunning.count() == 0


# -- imports from the working directory ----------------------------------------------------------------------------
def test_a_module_beside_the_run_is_loaded_without_putting_the_working_directory_on_the_import_path(
    tmp_path, monkeypatch
):
    """A config naming `my_rewards.accuracy` beside the run loads that file, and a package's submodule, without
    adding the working directory to `sys.path`: a `datasets.py` there must not replace the installed package for
    the rest of the run (a later `import datasets` reads the real one)."""
    import subprocess

    (tmp_path / "beside_rewards.py").write_text("def accuracy(**kwargs):\n    return 'beside'\n")
    (tmp_path / "beside_pkg").mkdir()
    (tmp_path / "beside_pkg" / "__init__.py").write_text("")
    (tmp_path / "beside_pkg" / "rules.py").write_text("def score(**kwargs):\n    return 'package'\n")
    (tmp_path / "datasets.py").write_text("raise SystemExit('the working directory shadowed datasets')\n")
    program = (
        "import sys\n"
        "from lit_rl.importing import import_callable\n"
        "before = list(sys.path)\n"
        "print(import_callable('beside_rewards.accuracy', 'reward')())\n"
        "print(import_callable('beside_pkg.rules.score', 'reward')())\n"
        "assert sys.path == before, sys.path\n"
        "import datasets\n"
        "print(datasets.__file__)\n"
    )
    env = {**cli_env(), "PYTHONSAFEPATH": "1"}  # as the `lit-rl` script: the working directory not on the path
    result = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.split()
    assert lines[:2] == ["beside", "package"] and str(tmp_path) not in lines[2]


def test_the_checks_processes_do_not_put_the_working_directory_first(tmp_path, monkeypatch):
    """`lit-rl check` starts a multi-process run with `python -m lit_rl.cli`, which would put the working directory
    first on the import path: it sets PYTHONSAFEPATH for it."""
    import lit_rl.check.runner as runner

    started = {}

    class Stopped:
        def wait(self, timeout=None):
            return 0

        def poll(self):
            return 0

    def popen(argv, stdout, stderr, env):
        started.update(argv=argv, env=env)
        return Stopped()

    monkeypatch.setattr(runner.subprocess, "Popen", popen)
    monkeypatch.setattr(runner, "_wait_or_stop", lambda run: 0)
    assert runner.run_cli(tmp_path, ["fit"], processes=2) == 0
    assert started["argv"][1:3] == ["-m", "lit_rl.cli"] and started["env"]["PYTHONSAFEPATH"] == "1"


# -- the broadcast transfer -------------------------------------------------------------------------------------------
def test_the_broadcast_rendezvous_listens_on_the_address_asked_and_only_until_the_workers_join():
    import socket
    import threading
    from datetime import timedelta

    from torch.distributed import PrefixStore, TCPStore
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    from lit_rl.rollout.server.collective_transfer import GlooGroup, listen, tcp_uri

    listener = listen("localhost", 0)  # a host name: the workers name the store by it too
    port = listener.getsockname()[1]
    assert listening_addresses(port) == ["127.0.0.1"]  # before: a store bound by torch listened on every interface
    received, built = torch.zeros(3), threading.Event()

    def worker() -> None:  # a server's worker, as vLLM's stateless_init_torch_distributed_process_group joins
        store = TCPStore("localhost", port, 2, False, timeout=timedelta(seconds=30))
        uri = tcp_uri("localhost", port)
        group = ProcessGroupGloo(PrefixStore(uri, store), 1, 2, timeout=timedelta(seconds=30))
        group._set_sequence_number_for_group()
        built.set()
        options = torch.distributed.BroadcastOptions()
        options.rootRank = 0
        group.broadcast([received], options).wait()

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    group = GlooGroup(listener, "localhost", 2, timeout_s=30)
    listener.close()
    assert built.wait(30)
    group.joined()  # as CollectiveTransfer.connect does once the server answers that its workers joined
    assert listening_addresses(port) == []  # nothing listens any more, on any address
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5)
    group.broadcast(torch.arange(3.0), give_up=lambda: False)  # the group itself still works
    thread.join(30)
    assert torch.equal(received, torch.arange(3.0))


def test_a_server_worker_refuses_weights_unlike_the_models_before_allocating_them():
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from lit_rl.rollout.in_server.vllm_transfer_plugin import GlooWeightTransferEngine, UpdateBudget

    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 8))  # 200 elements on this worker
    engine = object.__new__(GlooWeightTransferEngine)
    engine.group = SimpleNamespace()  # formed; a broadcast on it would fail: nothing may get that far

    def update(names, dtypes, shapes):
        engine.receive_weights(engine.parse_update_info({"names": names, "dtype_names": dtypes, "shapes": shapes}))

    engine.budget = None
    with pytest.raises(RuntimeError, match="without start_weight_update"):
        update(["0.weight"], ["float32"], [[16, 8]])
    refused = {
        "dtype": (["0.weight"], ["no_such_dtype"], [[16, 8]]),
        "shape": (["0.weight"], ["float32"], [[-1, 8]]),
        "dims": (["0.weight"], ["float32"], [[1] * 9]),
        "size": (["0.weight"], ["float32"], [[2**40]]),
        "name": ([""], ["float32"], [[4]]),
        "lengths": (["0.weight", "1.weight"], ["float32"], [[16, 8]]),
    }
    refused["wider"] = (["0.weight"], ["float64"], [[16, 8]])  # a legitimate shape, twice the bytes
    for what, request in refused.items():
        engine.budget = UpdateBudget(model, shards=2)  # the whole model: at most twice this worker's slice, 1600 B
        with pytest.raises(ValueError):
            update(*request)
        assert engine.budget.left_bytes == 2 * 1600, what  # nothing counted
    with pytest.raises(ValueError, match=r"0.weight: float64 is wider than the model's floats \(4 bytes\)"):
        update(*refused["wider"])
    budget = engine.budget = UpdateBudget(model, shards=2)
    budget.take(engine.parse_update_info({"names": ["a"], "dtype_names": ["bfloat16"], "shapes": [[32, 8]]}))
    with pytest.raises(ValueError, match="a: sent twice"):
        update(["a"], ["float32"], [[1]])
    with pytest.raises(ValueError, match=r"b: 1604 bytes, more than the whole model \(1600\)"):
        update(["b"], ["float32"], [[401]])
    # Tensors of a legitimate size, but more bytes in all than twice the model (3200): refused at the first over.
    budget.take(engine.parse_update_info({"names": ["c"], "dtype_names": ["float32"], "shapes": [[400]]}))
    assert budget.left_bytes == 3200 - 512 - 1600
    with pytest.raises(ValueError, match="e: the update would bring more than twice the model's bytes"):
        update(["d", "e"], ["float32"] * 2, [[200], [73]])
    assert budget.left_bytes == 1088 and budget.names == {"a", "c"}  # a refused chunk counts for nothing
    # A persistent integer buffer (a step counter, an expert map) is a legitimate tensor too.
    budget.take(
        engine.parse_update_info({"names": ["f", "g"], "dtype_names": ["float16", "int64"], "shapes": [[143], []]})
    )
