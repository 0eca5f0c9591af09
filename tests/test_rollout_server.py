"""The vLLM server client without vLLM: timeouts, retries with backoff, one-line errors naming the URL, and
what the engine makes of the server's answers. A stdlib HTTP server in a thread plays the vLLM server."""

from __future__ import annotations

import os
import socket
import sys
import time

import pytest
import torch

from lit_rl.rollout import SamplingParams, VLLMServer, WeightTransfer
from lit_rl.rollout.engines.vllm_server import RolloutServerError, VLLMServerEngine
from lit_rl.rollout.server.client import VLLMServerClient
from tests.fake_vllm import completions_answer as _completions


def test_5xx_answers_are_retried_then_succeed(fake_server, monkeypatch):
    monkeypatch.setattr(time, "sleep", lambda s: None)  # the backoff waits; not here
    server = fake_server((503, {"error": "busy"}, 0), (500, {"error": "busy"}, 0), (200, {"ok": 1}, 0))
    assert VLLMServerClient(server.url, timeout_s=5, max_retries=2).request("GET", "/x") == {"ok": 1}
    assert len(server.requests) == 3


def test_retries_exhausted_raise_one_line_naming_the_url(fake_server, monkeypatch):
    waits = []
    monkeypatch.setattr(time, "sleep", waits.append)
    server = fake_server((500, {"error": {"message": "EngineCore died"}}, 0))
    with pytest.raises(RolloutServerError) as info:
        VLLMServerClient(server.url, timeout_s=5, max_retries=3).request("POST", "/v1/completions", {})
    message = str(info.value)
    assert f"{server.url}/v1/completions" in message and "EngineCore died" in message and "\n" not in message
    assert [w for w in waits if w > 0] == [1.0, 2.0, 4.0]  # backoff between the 4 attempts (0: the fake server)


def test_4xx_answers_fail_at_once_with_the_servers_message(fake_server):
    server = fake_server((400, {"error": {"message": "max_tokens must be at least 1"}}, 0))
    with pytest.raises(RolloutServerError, match="HTTP 400: max_tokens must be at least 1"):
        VLLMServerClient(server.url, timeout_s=5, max_retries=3).request("POST", "/v1/completions", {})
    assert len(server.requests) == 1


def test_a_server_that_never_answers_times_out(fake_server):
    server = fake_server((200, {"ok": 1}, 3.0))
    started = time.monotonic()
    with pytest.raises(RolloutServerError, match="timed out|no answer"):
        VLLMServerClient(server.url, timeout_s=0.5, max_retries=0).request("GET", "/slow")
    assert time.monotonic() - started < 2.5


def test_nothing_listening_fails_after_waiting_for_the_server():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"  # bound, not listening: connections are refused
        started = time.monotonic()
        with pytest.raises(RolloutServerError) as info:
            VLLMServerEngine(VLLMServer(server_url=url, wait_for_server_s=1.0), [2], 0)
    assert f"{url}/health" in str(info.value) and "is the server running" in str(info.value)
    assert time.monotonic() - started < 10


def test_a_server_gone_between_generations_is_named_as_one_gone_during_one():
    """The health check before a generation and a request's last retry say the same: which of the two meets a
    server that died depends on timing alone."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        client = VLLMServerClient(url, timeout_s=1, max_retries=0)
        failures = []
        for call in (lambda: client.check_health(1.0), lambda: client.request("POST", "/v1/completions", {})):
            with pytest.raises(RolloutServerError) as info:
                call()
            failures.append(str(info.value))
    assert all(url in message and "is the server running" in message for message in failures), failures


def test_engine_groups_identical_prompts_and_pads_completions(fake_server, tmp_path):
    server = fake_server((200, _completions, 0))
    engine = VLLMServerEngine(
        VLLMServer(server_url=server.url, transfer=WeightTransfer(sync_dir=str(tmp_path))),
        eos_token_ids=[2],
        pad_token_id=0,
    )
    prompt_ids = torch.tensor([[0, 4, 5], [0, 4, 5], [0, 4, 5], [8, 9, 99]])  # left-padded; 3 copies of one prompt
    prompt_mask = torch.tensor([[0, 1, 1], [0, 1, 1], [0, 1, 1], [1, 1, 1]])
    torch.manual_seed(0)
    out = engine.generate(prompt_ids, prompt_mask, SamplingParams(max_new_tokens=3, temperature=0.7))
    # Requests go out concurrently: order them by size (3 completions, then 1).
    completions = sorted((b for _, path, b in server.requests if path == "/v1/completions"), key=lambda b: -b["n"])
    assert [(c["prompt"], c["n"]) for c in completions] == [([4, 5], 3), ([8, 9, 99], 1)]
    assert completions[0]["temperature"] == 0.7 and completions[0]["stop_token_ids"] == [2]
    # Nothing left for a server's generation_config defaults to fill (a repetition penalty the trainer never applies).
    neutral = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_p": 0.0}
    assert all({key: c[key] for key in neutral} == neutral for c in completions)
    first = completions[0]["seed"] % 7 + 10
    assert out.completion_ids.tolist() == [[first, 2, 0], [first + 1, 2, 0], [first + 2, 2, 0], [5, 6, 7]]
    assert out.completion_mask.tolist() == [[1, 1, 0], [1, 1, 0], [1, 1, 0], [1, 1, 1]]
    assert out.logprobs.tolist() == [[-0.5, -0.5, 0.0]] * 3 + [[-0.5] * 3]
    # Seeds come from the torch RNG: the same seed draws the same requests.
    torch.manual_seed(0)
    engine.generate(prompt_ids, prompt_mask, SamplingParams(max_new_tokens=3, temperature=0.7))
    again = [b for _, path, b in server.requests if path == "/v1/completions"][2:]
    assert sorted(c["seed"] for c in again) == sorted(c["seed"] for c in completions)


def test_greedy_copies_of_a_prompt_are_one_completion_copied(fake_server, tmp_path):
    """vLLM refuses n > 1 with greedy sampling (the fake server too): validation's batch padded with copies of a
    prompt asks for one completion, the same for every copy."""
    server = fake_server((200, _completions, 0))
    config = VLLMServer(server_url=server.url, transfer=WeightTransfer(sync_dir=str(tmp_path)))
    engine = VLLMServerEngine(config, eos_token_ids=[2], pad_token_id=0)
    prompt_ids = torch.tensor([[4, 5], [8, 9], [8, 9], [8, 9]])
    out = engine.generate(prompt_ids, torch.ones_like(prompt_ids), SamplingParams(max_new_tokens=3, temperature=0.0))
    completions = [b for _, path, b in server.requests if path == "/v1/completions"]
    assert sorted((c["prompt"], c["n"]) for c in completions) == [([4, 5], 1), ([8, 9], 1)]
    assert out.completion_ids[1].tolist() == out.completion_ids[2].tolist() == out.completion_ids[3].tolist()
    assert out.logprobs[1].tolist() == out.logprobs[3].tolist() == [-0.5, -0.5]


def test_a_closed_engine_samples_no_more_turns_for_a_job_still_running(fake_server, tmp_path):
    """A failed run closes its engine while rank 0's worker may still run a generation's episodes (a job already
    running cannot be cancelled): each of their next turns now fails at once instead of going to the server, so the
    job ends and the process can exit."""
    from lit_rl.rollout.server.client import RolloutServerError

    server = fake_server((200, _completions, 0))
    config = VLLMServer(server_url=server.url, transfer=WeightTransfer(sync_dir=str(tmp_path)))
    engine = VLLMServerEngine(config, eos_token_ids=[2], pad_token_id=0)
    prompt_ids = torch.tensor([[4, 5]])
    engine.concurrent_generate(prompt_ids, torch.ones_like(prompt_ids), SamplingParams(max_new_tokens=3))
    sent = len(server.requests)
    engine.close()
    with pytest.raises(RolloutServerError, match="the vLLM server engine is closed: the run has ended"):
        engine.concurrent_generate(prompt_ids, torch.ones_like(prompt_ids), SamplingParams(max_new_tokens=3))
    with pytest.raises(RolloutServerError, match="the vLLM server engine is closed"):
        engine._load_version(1)  # a job starting after the close pushes no weights into the server either
    assert len(server.requests) == sent


def test_weight_push_writes_safetensors_then_reloads_between_pause_and_resume(fake_server, tmp_path):
    from safetensors.torch import load_file

    server = fake_server((200, _completions, 0))
    engine = VLLMServerEngine(
        VLLMServer(server_url=server.url, transfer=WeightTransfer(sync_dir=str(tmp_path))), [2], 0
    )
    embed = torch.randn(4, 3)
    engine.update_weights([("model.embed_tokens.weight", embed), ("lm_head.weight", embed)])  # tied: one storage
    calls = [(method, path) for method, path, _ in server.requests][2:]  # after /health and /v1/models
    assert calls == [
        ("POST", "/pause?mode=wait"),
        ("POST", "/collective_rpc"),
        ("POST", "/reset_prefix_cache"),
        ("POST", "/resume"),
    ]
    rpc = server.requests[3][2]
    assert rpc == {"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path)}}
    written = load_file(tmp_path / "model-00000.safetensors")
    assert torch.equal(written["lm_head.weight"], embed) and torch.equal(written["model.embed_tokens.weight"], embed)
    assert [p.name for p in tmp_path.iterdir()] == ["model-00000.safetensors"]  # no temporary file left behind


def test_a_refused_prefix_cache_reset_is_asked_again_and_never_passed_over(fake_server, tmp_path):
    """vLLM answers `{"success": false}` while KV blocks are held: the push asks again until it succeeds (a kept
    cache would serve the old weights' keys and values for matching prompt prefixes); one that keeps refusing is
    an error naming the server, and the server is resumed either way."""
    refusals = iter([True, True])

    def answer(path, body):
        if path == "/reset_prefix_cache":
            return {"success": not next(refusals, False)}
        return _completions(path, body)

    server = fake_server((200, answer, 0))
    engine = VLLMServerEngine(
        VLLMServer(server_url=server.url, transfer=WeightTransfer(sync_dir=str(tmp_path))), [2], 0
    )
    engine.update_weights([("w", torch.ones(2))])
    calls = [path for _, path, _ in server.requests][2:]
    assert calls == ["/pause?mode=wait", "/collective_rpc", *["/reset_prefix_cache"] * 3, "/resume"]

    stuck = fake_server((200, lambda path, body: {"success": False}, 0))
    client = VLLMServerClient(stuck.url, timeout_s=5, max_retries=0)
    with pytest.raises(RolloutServerError) as info:
        client.reset_prefix_cache(wait_s=0.3)
    assert f"{stuck.url}/reset_prefix_cache: still refused" in str(info.value) and "\n" not in str(info.value)
    assert len(stuck.requests) > 1


def test_weight_push_writes_one_file_per_bucket_and_removes_the_last_push_files(fake_server, tmp_path):
    from safetensors.torch import load_file

    server = fake_server((200, _completions, 0))
    config = VLLMServer(server_url=server.url, push_bucket_mib=1 / 64, transfer=WeightTransfer(sync_dir=str(tmp_path)))
    engine = VLLMServerEngine(config, [2], 0)  # buckets of 16 KiB
    (tmp_path / "model-00007.safetensors").write_bytes(b"an earlier push")
    weights = [(f"w{i}", torch.full((1024,), float(i))) for i in range(10)]  # 4 KiB each
    engine.update_weights(iter(weights))
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["model-00000.safetensors", "model-00001.safetensors", "model-00002.safetensors"]
    shards = [load_file(tmp_path / name) for name in files]
    assert [sorted(shard) for shard in shards] == [["w0", "w1", "w2", "w3"], ["w4", "w5", "w6", "w7"], ["w8", "w9"]]
    assert all(torch.equal(shard[name], tensor) for shard in shards for name, tensor in weights if name in shard)


def test_a_failed_reload_still_resumes_the_server(fake_server, tmp_path, monkeypatch):
    def answer(path, body):
        return {"error": {"message": "Cannot find any model weights"}} if path == "/collective_rpc" else {}

    server = fake_server((200, {"data": [{"id": "policy"}]}, 0), (200, {"data": [{"id": "policy"}]}, 0))
    engine = VLLMServerEngine(
        VLLMServer(server_url=server.url, transfer=WeightTransfer(sync_dir=str(tmp_path))), [2], 0
    )
    server.script = [(200, answer, 0), (500, answer, 0), (200, answer, 0), (200, answer, 0)]
    with pytest.raises(RolloutServerError, match="Cannot find any model weights"):
        engine.update_weights([("w", torch.zeros(2))])
    assert [path for _, path, _ in server.requests][-1] == "/resume"


def test_any_failure_on_rank_0_becomes_one_server_error():
    from lit_rl.rollout.engines.vllm_server import _on_rank0_then_scatter

    with pytest.raises(RolloutServerError, match="vLLM server: ZeroDivisionError"):
        _on_rank0_then_scatter(lambda: [1 / 0], rank=0, world_size=1)


def test_malformed_answers_are_named_errors(fake_server, tmp_path):
    server = fake_server((200, {"data": []}, 0))
    with pytest.raises(RolloutServerError, match="/v1/models lists no model"):
        VLLMServerEngine(VLLMServer(server_url=server.url, transfer=WeightTransfer(sync_dir=str(tmp_path))), [2], 0)
    models = (200, {"data": [{"id": "policy"}]}, 0)
    completions = fake_server(models, models, (200, {"choices": [{"index": 0}]}, 0))  # /health, /v1/models, ...
    config = VLLMServer(server_url=completions.url, transfer=WeightTransfer(sync_dir=str(tmp_path)))
    engine = VLLMServerEngine(config, [2], 0)
    with pytest.raises(RolloutServerError, match="without token_ids or log-probs"):
        engine.generate(torch.tensor([[4, 5]]), torch.ones(1, 2, dtype=torch.long), SamplingParams())


def test_the_default_weight_directory_is_removed_on_close(fake_server):
    import os

    server = fake_server((200, {"data": [{"id": "policy"}]}, 0))
    engine = VLLMServerEngine(VLLMServer(server_url=server.url), [2], 0)
    directory = engine.sync_dir
    assert os.path.isdir(directory)
    engine.close()
    assert not os.path.exists(directory)


def test_a_failed_write_still_consumes_the_whole_weight_stream(fake_server, tmp_path):
    # Under ZeRO-3 every rank gathers through its stream in step: rank 0 must finish its stream even when writing
    # fails, or the other ranks wait in the next gather forever.
    server = fake_server((200, _completions, 0))
    engine = VLLMServerEngine(
        VLLMServer(server_url=server.url, transfer=WeightTransfer(sync_dir=str(tmp_path))), [2], 0
    )
    consumed = []

    def stream():
        for i in range(5):
            consumed.append(i)
            yield (f"w{i}", torch.zeros(2) if i != 1 else "not a tensor")

    with pytest.raises(RolloutServerError, match="AttributeError"):
        engine.update_weights(stream())
    assert consumed == [0, 1, 2, 3, 4]


def test_other_ranks_follow_rank_0s_view_of_the_servers(fake_server, tmp_path):
    """With several ranks sending their own turns, each follows rank 0's view of the servers, shared with every push:
    a launched server's URL (its port only rank 0 knows), the model name it learned, and which servers are in
    service (one rank 0 took out missed the weights). Rank 0's own view is never overwritten."""
    server = fake_server((200, _completions, 0))
    config = VLLMServer(server_url=server.url, transfer=WeightTransfer(sync_dir=str(tmp_path)))
    engine = VLLMServerEngine(config, eos_token_ids=[2], pad_token_id=0)
    (own,) = engine.pool.servers
    assert engine.concurrent_on_every_rank  # one process: always
    view = [("http://127.0.0.1:9", "served-elsewhere", False)]
    engine._follow(view)  # rank 0: its view is the one shared
    assert (own.url, own.in_service) == (server.url, True) and own.model_name != "served-elsewhere"
    engine.rank = 1
    engine._follow(view)
    assert (own.url, own.model_name, own.in_service) == ("http://127.0.0.1:9", "served-elsewhere", False)
    assert own.client.timeout_s == engine.config.request_timeout_s


@pytest.mark.parametrize(
    "url, loopback",
    [
        ("http://127.0.0.1:8000", True),
        ("http://localhost:8000", True),
        ("http://[::1]:8000", True),
        ("http://0.0.0.0:8000", True),
        ("http://[::ffff:127.0.0.1]:8000", True),
        ("http://10.0.0.5:8000", False),
    ],
)
def test_a_loopback_server_url_is_known_as_such(url, loopback):
    from lit_rl.rollout.engines.vllm_server import _is_loopback

    assert _is_loopback(url) is loopback


SAMPLE_APART_CASES = {  # case: (server URLs, on_server_failure, a host name per rank, ranks reaching the servers)
    "one machine, every rank reaches the server": (["http://127.0.0.1:8000"], "stop", ["a", "a"], [0, 1]),
    "rank 1 cannot reach the server": (["http://127.0.0.1:8000"], "stop", ["a", "a"], [0]),
    "two machines, a loopback URL": (["http://127.0.0.1:8000"], "stop", ["a", "b"], [0, 1]),
    "two machines, a routable URL": (["http://10.0.0.5:8000"], "stop", ["a", "b"], [0, 1]),
    "several servers, on_server_failure continue": (
        ["http://10.0.0.5:8000", "http://10.0.0.6:8000"],
        "continue",
        ["a", "a"],
        [0, 1],
    ),
}


def _may_sample_alone(rank: int, init_file: str, out: str) -> None:
    """One rank of `test_ranks_sample_apart_only_where_every_rank_reaches_every_server`: each case's decision."""
    import json
    from types import SimpleNamespace
    from unittest import mock

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    decisions = {}
    for case, (urls, on_failure, hosts, reaching) in SAMPLE_APART_CASES.items():

        def check_health(timeout_s, reached=rank in reaching):
            if not reached:
                raise RolloutServerError("connection refused")

        servers = [SimpleNamespace(url=url, client=SimpleNamespace(check_health=check_health)) for url in urls]
        engine = SimpleNamespace(
            world_size=2,
            pool=SimpleNamespace(servers=servers, in_service=lambda servers=servers: servers, health_timeout_s=1.0),
            config=SimpleNamespace(on_server_failure=on_failure),
        )
        with mock.patch("socket.gethostname", return_value=hosts[rank]):
            decisions[case] = VLLMServerEngine._every_rank_may_sample_alone(engine)
    dist.destroy_process_group()
    with open(f"{out}.{rank}", "w") as handle:
        json.dump(decisions, handle)


def test_ranks_sample_apart_only_where_every_rank_reaches_every_server(tmp_path):
    """`concurrent_on_every_rank` on two gloo processes: the ranks send their own turns only when each reached every
    server and no loopback URL spans machines, and never with several servers and `on_server_failure: continue`;
    every rank comes to the same decision (else one would wait in a collective the other skipped)."""
    import json

    import torch.multiprocessing as mp

    out = str(tmp_path / "decisions")
    mp.start_processes(_may_sample_alone, args=(str(tmp_path / "init"), out), nprocs=2, start_method="spawn")
    ranks = [json.loads(open(f"{out}.{rank}").read()) for rank in range(2)]
    expected = {
        "one machine, every rank reaches the server": True,
        "rank 1 cannot reach the server": False,
        "two machines, a loopback URL": False,
        "two machines, a routable URL": True,
        "several servers, on_server_failure continue": False,
    }
    assert ranks == [expected, expected]


def test_weights_folders_of_killed_trainers_are_removed_and_no_other(tmp_path):
    """A trainer killed by SIGKILL or the OOM killer never removes its weights' folder, a copy of the model in
    /dev/shm (RAM) until the machine restarts: the next server engine removes it. A live process's folder, one
    changed within the hour (a run in another PID namespace) and one named otherwise stay."""
    import subprocess

    from lit_rl.rollout.engines.vllm_server import STALE_WEIGHTS_S, remove_stale_weight_dirs

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid no process has now
    folders = {
        "dead": tmp_path / f"lit-rl-weights-{gone.pid}-abc",
        "live": tmp_path / f"lit-rl-weights-{os.getpid()}-abc",
        "recent": tmp_path / f"lit-rl-weights-{gone.pid}-new",
        "other": tmp_path / "lit-rl-weights",  # a receiver's --dir, as docs name it
    }
    for folder in folders.values():
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"x")
    old = time.time() - STALE_WEIGHTS_S - 60
    for name in ("dead", "live", "other"):
        os.utime(folders[name], (old, old))
    assert remove_stale_weight_dirs(tmp_path) == [folders["dead"]]
    assert [name for name, folder in folders.items() if folder.exists()] == ["live", "recent", "other"]
    os.utime(folders["recent"], (old, old))
    assert remove_stale_weight_dirs(tmp_path, now=time.time()) == [folders["recent"]]
