"""Weights for a vLLM server on another machine (`lit_rl.rollout.server.weight_receiver`): uploads checked by SHA-256
and committed in one rename, nothing written outside the receiver's directory, one-line errors naming the URL, and the
server engine reloading the committed copy (a fake vLLM server plays the server)."""

from __future__ import annotations

import threading

import pytest
import torch

from lit_rl.errors import ConfigError
from lit_rl.rollout import VLLMServer, WeightTransfer
from lit_rl.rollout.engines.vllm_server import RolloutServerError, VLLMServerEngine
from lit_rl.rollout.server.weight_receiver import WeightReceiver, WeightTransferError, WeightUploader, sha256_of
from tests.fake_vllm import completions_answer as _completions


@pytest.fixture
def receiver(tmp_path):
    server = WeightReceiver(tmp_path / "received")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.stop()


def test_an_upload_is_checked_and_committed_as_one_directory(receiver, tmp_path):
    local = tmp_path / "local"
    local.mkdir()
    (local / "model-00000.safetensors").write_bytes(b"first shard" * 1000)
    (local / "model-00001.safetensors").write_bytes(b"second")
    path = WeightUploader(receiver.url, timeout_s=5, max_retries=0).upload(local, "v3")
    assert path == str((tmp_path / "received" / "v3.1").resolve())  # each commit a new name
    for name in ("model-00000.safetensors", "model-00001.safetensors"):
        assert sha256_of(f"{path}/{name}") == sha256_of(local / name)
    assert not (tmp_path / "received" / ".incoming-v3").exists()
    WeightUploader(receiver.url, timeout_s=5, max_retries=0).delete("v3")
    assert not (tmp_path / "received" / "v3.1").exists()


def test_damaged_incomplete_or_escaping_uploads_are_refused(receiver, tmp_path):
    def put(path, data, digest):
        request = urllib.request.Request(
            receiver.url + path, data=data, method="PUT", headers={"X-Content-SHA256": digest}
        )
        try:
            return urllib.request.urlopen(request, timeout=5).status
        except urllib.error.HTTPError as err:
            return err.code

    import hashlib
    import urllib.error

    assert put("/files/v1/a.safetensors", b"bytes", hashlib.sha256(b"other").hexdigest()) == 400
    assert put("/files/v1/..%2F..%2Fescape", b"x", hashlib.sha256(b"x").hexdigest()) == 400
    assert put("/files/../escape", b"x", hashlib.sha256(b"x").hexdigest()) == 400
    assert not list(tmp_path.glob("**/escape*"))
    assert put("/files/v1/a.safetensors", b"bytes", hashlib.sha256(b"bytes").hexdigest()) == 200
    # The commit names a file that never arrived: nothing is committed, the version does not exist.
    uploader = WeightUploader(receiver.url, timeout_s=5, max_retries=0)
    with pytest.raises(WeightTransferError, match="POST /commit/v1 failed: HTTP 409"):
        uploader._request("POST", "/commit/v1", b'{"files": {"a.safetensors": "0", "b.safetensors": "0"}}', {})
    assert not list((tmp_path / "received").glob("v1*"))


def test_a_token_is_required_when_the_receiver_has_one(tmp_path, monkeypatch):
    server = WeightReceiver(tmp_path / "received", token="s3cret")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        (tmp_path / "f").write_bytes(b"w")
        local = tmp_path / "local"
        local.mkdir()
        (local / "f").write_bytes(b"w")
        with pytest.raises(WeightTransferError, match="HTTP 401"):
            WeightUploader(server.url, timeout_s=5, max_retries=0).upload(local, "v1")
        monkeypatch.setenv("LIT_RL_RECEIVER_TOKEN", "s3cret")
        assert WeightUploader(server.url, timeout_s=5, max_retries=0).upload(local, "v1").endswith("v1.1")
    finally:
        server.stop()


def test_the_engine_uploads_then_reloads_the_committed_copy_and_a_dead_receiver_stops_it(
    fake_server,  # noqa: F811 (the fixture imported above)
    receiver,
    tmp_path,
):
    from safetensors.torch import load_file

    server = fake_server((200, _completions, 0))
    config = VLLMServer(server_url=server.url, transfer=WeightTransfer(receiver_url=receiver.url))
    engine = VLLMServerEngine(config, [2], 0)
    weights = torch.randn(4, 3)
    engine.update_weights([("model.embed_tokens.weight", weights)])
    rpc = [body for _, path, body in server.requests if path == "/collective_rpc"][-1]
    reloaded = rpc["kwargs"]["weights_path"]
    assert reloaded == str((tmp_path / "received" / "current.1").resolve())
    assert torch.equal(load_file(f"{reloaded}/model-00000.safetensors")["model.embed_tokens.weight"], weights)
    engine.close()

    receiver.stop()
    before = len(server.requests)
    dead = VLLMServerEngine(config, [2], 0)
    with pytest.raises(RolloutServerError, match=rf"weight upload to {receiver.url}: PUT .* unreachable"):
        dead.update_weights([("model.embed_tokens.weight", weights)])
    # The upload failed before the server was paused: it keeps serving the weights it had.
    assert "/pause?mode=wait" not in [path for _, path, _ in server.requests[before:]]
    dead.close()


def test_settings_name_what_is_missing():
    with pytest.raises(ConfigError, match="transfer.method: http needs model.rollout.engine.transfer.receiver_url"):
        VLLMServer(transfer=WeightTransfer(method="http")).check()
    with pytest.raises(ConfigError, match="is not on this machine"):
        VLLMServer(server_url="http://10.1.2.3:8000").check()
    VLLMServer(server_url="http://10.1.2.3:8000", transfer=WeightTransfer(receiver_url="http://10.1.2.3:8010")).check()
    VLLMServer(server_url="http://10.1.2.3:8000", transfer=WeightTransfer(sync_dir="/shared/w")).check()


def test_staged_versions_for_asynchronous_rollouts_go_through_the_receiver(fake_server, receiver, tmp_path):  # noqa: F811
    """Asynchronous rollouts stage each version ahead: each is uploaded as `v<N>`, the server reloads the
    receiver's copy when that version's first generation runs, and older copies are removed from the receiver."""
    from lit_rl.rollout import SamplingParams

    server = fake_server((200, _completions, 0))
    engine = VLLMServerEngine(
        VLLMServer(server_url=server.url, transfer=WeightTransfer(receiver_url=receiver.url)), [2], 0
    )
    prompt, mask = torch.tensor([[4, 5]]), torch.ones(1, 2, dtype=torch.long)
    for version in (1, 2):
        engine.stage_weights([("w", torch.full((2,), float(version)))], version)
    for version in (1, 2):
        out = engine.collect(engine.submit(prompt, mask, SamplingParams(), [version], version))
        assert out.completion_ids.shape[0] == 1
    reloads = [body["kwargs"]["weights_path"] for _, path, body in server.requests if path == "/collective_rpc"]
    received = tmp_path / "received"
    # One number sequence for every tag (none given twice): v2's commit is the receiver's second.
    assert reloads == [str((received / "v1.1").resolve()), str((received / "v2.2").resolve())]
    assert not (received / "v1.1").exists() and (received / "v2.2").exists()
    assert [p.name for p in received.iterdir() if p.name.startswith(".last")] == [".last-number"]  # one record
    engine.close()


def test_the_commit_trusts_digests_checked_on_arrival_and_hashes_again_after_a_restart(tmp_path):
    """Files of several shards go up at once; the commit uses the digests checked as they arrived, and a receiver
    restarted between the uploads and the commit (no record) hashes the staged files again: damage is refused."""
    import json

    source = tmp_path / "source"
    source.mkdir()
    for index in range(6):
        (source / f"model-{index:05d}.safetensors").write_bytes(bytes([index]) * 5000)
    first = WeightReceiver(tmp_path / "received")
    threading.Thread(target=first.serve_forever, daemon=True).start()
    uploader = WeightUploader(first.url, timeout_s=5, max_retries=0)
    stored = uploader.upload(source, "v1")
    assert sorted(p.name for p in (tmp_path / "received" / "v1.1").iterdir()) == sorted(
        p.name for p in source.iterdir()
    )
    assert first.verified == {}  # every record was used by the commit
    for path in source.iterdir():
        headers = {"X-Content-SHA256": sha256_of(path), "Content-Length": str(path.stat().st_size)}
        uploader._request("PUT", f"/files/v2/{path.name}", path, headers)
    first.stop()
    restarted = WeightReceiver(tmp_path / "received")
    threading.Thread(target=restarted.serve_forever, daemon=True).start()
    try:
        (restarted.staging("v2") / "model-00003.safetensors").write_bytes(b"damaged on disk")
        digests = {path.name: sha256_of(path) for path in source.iterdir()}
        again = WeightUploader(restarted.url, timeout_s=5, max_retries=0)
        with pytest.raises(WeightTransferError, match="HTTP 409"):
            again._request("POST", "/commit/v2", json.dumps({"files": digests}).encode(), {})
    finally:
        restarted.stop()
    assert stored.endswith("v1.1") and not list((tmp_path / "received").glob("v2*"))


def test_the_bytes_stored_count_files_that_other_requests_rename_or_remove_meanwhile(tmp_path):
    """A PUT counts the receiver's bytes while other PUTs rename their partial files and remove failed ones: a file
    gone between the listing and its lstat is not counted (under load it ended the request, unanswered)."""
    receiver = WeightReceiver(tmp_path / "received")
    staging = receiver.staging("v1")
    staging.mkdir(mode=0o700)
    (staging / "kept.safetensors").write_bytes(b"x" * 100)
    names = [staging / f".model-{i}.part" for i in range(50)]
    stop = threading.Event()

    def other_requests() -> None:  # partial files appear, become their names, and go
        while not stop.is_set():
            for partial in names:
                partial.write_bytes(b"y")
                partial.replace(partial.with_suffix(".safetensors"))
                partial.with_suffix(".safetensors").unlink()

    thread = threading.Thread(target=other_requests, daemon=True)
    thread.start()
    try:
        counts = [receiver.bytes_stored() for _ in range(300)]
    finally:
        stop.set()
        thread.join(10)
    assert all(100 <= count <= 150 for count in counts)
    assert receiver.bytes_stored() == 100


def test_the_receivers_command_binds_loopback_unless_told_otherwise(tmp_path):
    """`python -m lit_rl.rollout.server.weight_receiver` (docs/rollouts.md's command) without `--host`: the kernel
    lists its socket on 127.0.0.1 alone (the class's default is checked apart; this is the command's own)."""
    import subprocess
    import sys

    from tests.conftest import cli_env, listening_addresses

    command = [sys.executable, "-m", "lit_rl.rollout.server.weight_receiver", "--dir", str(tmp_path / "w")]
    process = subprocess.Popen(
        [*command, "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env()
    )
    try:
        line = process.stdout.readline()
        assert line.startswith("lit-rl weight receiver on http://127.0.0.1:"), line + process.stderr.read()
        port = int(line.split("http://127.0.0.1:", 1)[1].split(",", 1)[0])
        assert listening_addresses(port) == ["127.0.0.1"]
    finally:
        process.terminate()
        process.wait(timeout=30)
