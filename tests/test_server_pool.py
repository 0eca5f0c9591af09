"""Several vLLM servers (`model.rollout.engine.server_urls`) without vLLM: requests dealt out across them with
completions that do not depend on the split, pushes to every server, health checks, and what a dead server does under
`on_server_failure: fail | continue`. Stdlib servers in threads play vLLM (`tests/fake_vllm.py`)."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from lit_rl.errors import ConfigError
from lit_rl.rollout import SamplingParams, VLLMServer, WeightTransfer
from lit_rl.rollout.engines.vllm_server import RolloutServerError, VLLMServerEngine
from lit_rl.rollout.server.weight_receiver import WeightReceiver, WeightUploader
from tests.fake_vllm import completions_answer

# 4 prompts x 2 completions (left-padded): 4 requests of n=2.
PROMPTS = torch.tensor([[0, 4, 5], [0, 4, 5], [6, 4, 5], [6, 4, 5], [7, 8, 9], [7, 8, 9], [0, 3, 3], [0, 3, 3]])
MASK = (PROMPTS != 0).long()
PARAMS = SamplingParams(max_new_tokens=3, temperature=0.7)
RELOAD = ["/pause?mode=wait", "/collective_rpc", "/reset_prefix_cache", "/resume"]


def _engine(servers, tmp_path, transfer=None, **config):
    urls = [server.url for server in servers]
    transfer = WeightTransfer(sync_dir=str(tmp_path), **(transfer or {}))
    vllm = VLLMServer(server_urls=urls, max_retries=0, transfer=transfer, **config)
    vllm.check()
    return VLLMServerEngine(vllm, eos_token_ids=[2], pad_token_id=0)


def _generate(engine, seed=0):
    torch.manual_seed(seed)
    return engine.generate(PROMPTS, MASK, PARAMS)


def _paths(server, path):
    return [body for _, p, body in server.requests if p == path]


def test_requests_are_dealt_across_the_servers_and_the_completions_do_not_depend_on_the_split(fake_server, tmp_path):
    one = fake_server((200, completions_answer, 0))
    a, b = fake_server((200, completions_answer, 0)), fake_server((200, completions_answer, 0))
    alone = _generate(_engine([one], tmp_path / "1"))
    split = _generate(_engine([a, b], tmp_path / "2"))
    assert len(_paths(a, "/v1/completions")) == 2 and len(_paths(b, "/v1/completions")) == 2
    assert {tuple(body["prompt"]) for body in _paths(a, "/v1/completions") + _paths(b, "/v1/completions")} == {
        (4, 5),
        (6, 4, 5),
        (7, 8, 9),
        (3, 3),
    }
    assert torch.equal(split.completion_ids, alone.completion_ids)
    assert torch.equal(split.logprobs, alone.logprobs)
    # Each server was health-checked before the generation.
    assert len(_paths(a, "/health")) == 2 and len(_paths(b, "/health")) == 2  # connect + before the generation


def test_single_requests_from_many_threads_go_round_the_servers_within_the_in_flight_bound(
    fake_server, tmp_path, monkeypatch
):
    """Independent episodes send one request a call, from many threads (`concurrent_generate`): the calls go round
    the servers in turn (not all to the first), with no health check each, and at most `MAX_REQUESTS_PER_SERVER`
    per server are in flight across the calls."""
    from concurrent.futures import ThreadPoolExecutor

    from lit_rl.rollout.server import pool as pool_module

    monkeypatch.setattr(pool_module, "MAX_REQUESTS_PER_SERVER", 2)
    in_flight, most, lock = [0], [0], threading.Lock()

    def slow_answer(path, body):
        if path != "/v1/completions":
            return completions_answer(path, body)
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
        time.sleep(0.05)
        with lock:
            in_flight[0] -= 1
        return completions_answer(path, body)

    a, b = fake_server((200, slow_answer, 0)), fake_server((200, slow_answer, 0))
    engine = _engine([a, b], tmp_path)
    rows = [(PROMPTS[i : i + 1], MASK[i : i + 1]) for i in range(0, 8, 2)] * 3  # 12 single-request calls
    with ThreadPoolExecutor(max_workers=12) as threads:
        outs = list(threads.map(lambda row: engine.concurrent_generate(*row, PARAMS, seeds=[5]), rows))
    assert all(out.completion_ids.shape[0] == 1 for out in outs)
    assert len(_paths(a, "/v1/completions")) == 6 and len(_paths(b, "/v1/completions")) == 6
    assert len(_paths(a, "/health")) == 1 and len(_paths(b, "/health")) == 1  # at connect only
    assert most[0] == 4  # 2 servers x 2, though 12 calls were made at once


def test_a_push_reaches_every_server_between_its_pause_and_resume(fake_server, tmp_path):
    a, b = fake_server((200, completions_answer, 0)), fake_server((200, completions_answer, 0))
    engine = _engine([a, b], tmp_path)
    engine.update_weights([("w", torch.ones(3))])
    for server in (a, b):
        calls = [path for _, path, _ in server.requests][2:]  # after /health and /v1/models
        assert calls == RELOAD
        assert _paths(server, "/collective_rpc")[0]["kwargs"]["weights_path"] == str(tmp_path)


def test_a_dead_server_stops_the_run_in_one_line_naming_it_by_default(fake_server, tmp_path):
    a, b = fake_server((200, completions_answer, 0)), fake_server((200, completions_answer, 0))
    engine = _engine([a, b], tmp_path)
    b.close()
    with pytest.raises(RolloutServerError) as info:
        _generate(engine)
    assert f"{b.url}/health" in str(info.value) and "\n" not in str(info.value)
    assert _paths(a, "/v1/completions") == []  # stopped at the health check, before any request went out


def test_continue_takes_a_dead_server_out_with_one_warning_and_deals_its_requests_to_the_others(
    fake_server, tmp_path, caplog
):
    one = fake_server((200, completions_answer, 0))
    servers = [fake_server((200, completions_answer, 0)) for _ in range(3)]
    alone = _generate(_engine([one], tmp_path / "1"))
    engine = _engine(servers, tmp_path / "3", on_server_failure="continue")
    servers[1].close()
    with caplog.at_level(logging.WARNING, logger="lit_rl.rollout.server.pool"):
        first = _generate(engine)
        second = _generate(engine)
    for out in (first, second):
        assert torch.equal(out.completion_ids, alone.completion_ids)
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 1 and servers[1].url in warnings[0] and "taken out of service" in warnings[0]
    assert "\n" not in warnings[0]
    # Its share went to the other two, which were both health-checked again before the second generation.
    assert len(_paths(servers[0], "/v1/completions")) + len(_paths(servers[2], "/v1/completions")) == 8
    assert [len(_paths(s, "/health")) for s in (servers[0], servers[2])] == [3, 3]
    # Later pushes skip it.
    engine.update_weights([("w", torch.ones(3))])
    assert all(_paths(s, "/collective_rpc") for s in (servers[0], servers[2]))


def _engine_died(path, body):
    """A live HTTP front end whose engine died: healthy, but completions fail."""
    return (500, {"error": "EngineCore died"}) if path == "/v1/completions" else completions_answer(path, body)


def _aborting(path, body):
    """vLLM shutting down (SIGTERM) or paused with mode=abort: 200, with each completion's tokens so far."""
    answer = completions_answer(path, body)
    if path == "/v1/completions":
        for choice in answer["choices"]:
            choice["token_ids"], choice["finish_reason"] = choice["token_ids"][:1], "abort"
            choice["logprobs"]["token_logprobs"] = choice["logprobs"]["token_logprobs"][:1]
    return answer


@pytest.mark.parametrize(
    ("failing", "message"), [(_engine_died, "EngineCore died"), (_aborting, "finish_reason 'abort'")]
)
def test_a_server_failing_mid_generation_hands_its_requests_to_the_others(
    fake_server, tmp_path, caplog, failing, message
):
    one = fake_server((200, completions_answer, 0))
    a, b = fake_server((200, completions_answer, 0)), fake_server((200, failing, 0))
    alone = _generate(_engine([one], tmp_path / "1"))
    engine = _engine([a, b], tmp_path / "2", on_server_failure="continue")
    with caplog.at_level(logging.WARNING, logger="lit_rl.rollout.server.pool"):
        out = _generate(engine)
    # Its requests went to `a` whole: the completions are the one-server run's (none truncated by an abort).
    assert torch.equal(out.completion_ids, alone.completion_ids) and torch.equal(out.logprobs, alone.logprobs)
    failed = len(_paths(b, "/v1/completions"))
    assert failed >= 1  # it was dealt requests; each failed and went to `a`
    assert len(_paths(a, "/v1/completions")) == 4
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 1 and b.url in warnings[0] and message in warnings[0]


def test_completions_cut_short_by_an_abort_stop_a_single_server_run_in_one_line(fake_server, tmp_path):
    with pytest.raises(RolloutServerError, match="finish_reason 'abort', cut short") as info:
        _generate(_engine([fake_server((200, _aborting, 0))], tmp_path))
    assert "\n" not in str(info.value)


def test_the_last_server_in_service_failing_stops_the_run(fake_server, tmp_path, caplog):
    a, b = fake_server((200, completions_answer, 0)), fake_server((200, completions_answer, 0))
    engine = _engine([a, b], tmp_path, on_server_failure="continue")
    a.close()
    b.close()
    with pytest.raises(RolloutServerError, match="no other vLLM server is left in service") as info:
        _generate(engine)
    assert "\n" not in str(info.value)


def test_servers_sharing_a_receiver_get_one_upload_and_each_reloads_from_it(fake_server, tmp_path, monkeypatch):
    receiver = WeightReceiver(tmp_path / "received")
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    uploads = []
    upload = WeightUploader.upload
    monkeypatch.setattr(WeightUploader, "upload", lambda self, d, tag: uploads.append(tag) or upload(self, d, tag))
    try:
        a, b = fake_server((200, completions_answer, 0)), fake_server((200, completions_answer, 0))
        engine = _engine([a, b], tmp_path / "local", transfer={"receiver_url": receiver.url})
        engine.update_weights([("w", torch.ones(3))])
    finally:
        receiver.stop()
    assert uploads == ["current"]
    stored = str(tmp_path / "received" / "current.1")
    for server in (a, b):
        assert _paths(server, "/collective_rpc")[0]["kwargs"]["weights_path"] == stored


def test_asynchronous_generations_load_each_version_once_on_every_server(fake_server, tmp_path):
    a, b = fake_server((200, completions_answer, 0)), fake_server((200, completions_answer, 0))
    engine = _engine([a, b], tmp_path)
    for version in (1, 1, 2):
        engine.stage_weights([("w", torch.full((3,), float(version)))], version)
        ticket = engine.submit(PROMPTS, MASK, PARAMS, seeds=list(range(8)), version=version)
        engine.collect(ticket)
    engine.close()
    for server in (a, b):
        loaded = [body["kwargs"]["weights_path"] for body in _paths(server, "/collective_rpc")]
        assert loaded == [str(tmp_path / "v1"), str(tmp_path / "v2")]
    assert not (tmp_path / "v1").exists()  # an older version is removed once the newer one is loaded


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"server_urls": "http://127.0.0.1:8000"}, "model.rollout.engine.server_urls must be a non-empty list"),
        ({"server_urls": []}, "model.rollout.engine.server_urls must be a non-empty list"),
        ({"server_urls": ["127.0.0.1:8000"]}, "model.rollout.engine.server_urls: each URL must start with http"),
        ({"server_urls": ["http://127.0.0.1:1", "http://127.0.0.1:1"]}, "lists a server twice"),
        (
            {"server_urls": ["http://127.0.0.1:1"], "transfer": {"receiver_urls": ["http://a:1", "http://b:1"]}},
            "as many entries",
        ),
        (
            {"transfer": {"receiver_urls": ["http://a:1"]}},
            "model.rollout.engine.transfer.receiver_urls needs model.rollout.engine.server_urls",
        ),
        ({"on_server_failure": "retry"}, "model.rollout.engine.on_server_failure must be fail or continue"),
        ({"server_urls": ["http://127.0.0.1:1", "http://10.0.0.2:8000"]}, "http://10.0.0.2:8000 is not on this"),
    ],
)
def test_bad_server_lists_are_refused_in_one_line_naming_the_key(settings, message):
    with pytest.raises(ConfigError, match=message) as info:
        VLLMServer(**settings).check()
    assert "\n" not in str(info.value)


def test_one_receiver_per_server_in_order():
    config = VLLMServer(
        server_urls=["http://10.0.0.2:8000", "http://10.0.0.2:8001", "http://10.0.0.3:8000"],
        transfer=WeightTransfer(receiver_urls=["http://10.0.0.2:8010", "http://10.0.0.2:8010", "http://10.0.0.3:8010"]),
    )
    config.check()
    assert config.server_endpoints() == [
        ("http://10.0.0.2:8000", "http://10.0.0.2:8010"),
        ("http://10.0.0.2:8001", "http://10.0.0.2:8010"),
        ("http://10.0.0.3:8000", "http://10.0.0.3:8010"),
    ]


def test_the_health_check_has_its_own_short_timeout(fake_server, tmp_path):
    a = fake_server((200, completions_answer, 0))
    engine = _engine([a], tmp_path, request_timeout_s=1.0)
    a.script = [(200, completions_answer, 3.0)]  # hangs: the health check gives up after request_timeout_s
    started = time.monotonic()
    with pytest.raises(RolloutServerError, match="health check"):
        _generate(engine)
    assert time.monotonic() - started < 2.5


def test_a_server_that_answers_again_is_taken_back_at_the_next_push_with_the_weights(fake_server, tmp_path, caplog):
    one = fake_server((200, completions_answer, 0))
    alone = _generate(_engine([one], tmp_path / "1"))
    a, b = fake_server((200, completions_answer, 0)), fake_server((200, completions_answer, 0))
    engine = _engine([a, b], tmp_path / "2", on_server_failure="continue")
    b.script = [(503, {"error": "restarting"}, 0)]
    with caplog.at_level(logging.WARNING, logger="lit_rl.rollout.server.pool"):
        _generate(engine)  # b fails its health check: out
        engine.update_weights([("w", torch.ones(3))])  # b still down: stays out, silently
        b.script = [(200, completions_answer, 0)]  # its supervisor restarted it
        _generate(engine)
        assert len(_paths(b, "/v1/completions")) == 0  # not before it has the weights
        engine.update_weights([("w", torch.ones(3))])  # answers again: loads the weights, back in service
        out = _generate(engine)
    assert torch.equal(out.completion_ids, alone.completion_ids)
    assert [path for _, path, _ in b.requests if path in RELOAD] == RELOAD  # one reload: the second push's
    assert len(_paths(b, "/v1/completions")) == 2  # its half of the last generation
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 2 and "taken out of service" in messages[0] and "back in service" in messages[1]


def test_a_server_back_without_the_rl_endpoints_stays_out_and_the_run_goes_on(fake_server, tmp_path, caplog):
    def no_dev_mode(path, body):  # restarted without VLLM_SERVER_DEV_MODE: healthy, but /pause is 404
        return (404, {"detail": "Not Found"}) if path.startswith("/pause") else completions_answer(path, body)

    a, b = fake_server((200, completions_answer, 0)), fake_server((200, completions_answer, 0))
    engine = _engine([a, b], tmp_path, on_server_failure="continue")
    b.script = [(503, {"error": "restarting"}, 0)]
    _generate(engine)
    b.script = [(200, no_dev_mode, 0)]
    engine.update_weights([("w", torch.ones(3))])  # b answers /health but cannot reload: not taken back
    _generate(engine)
    assert not [body for body in _paths(b, "/v1/completions")]
    assert [server.in_service for server in engine.pool.servers] == [True, False]


def test_servers_on_one_receiver_share_its_copy_of_a_version(tmp_path):
    from lit_rl.rollout.server.pool import ServerPool

    config = VLLMServer(
        server_urls=["http://10.0.0.2:8000", "http://10.0.0.2:8001/"],
        # One receiver, spelled two ways.
        transfer=WeightTransfer(receiver_urls=["http://10.0.0.2:8010", "http://10.0.0.2:8010/"]),
    )
    config.check()
    pool = ServerPool(config)
    assert len(pool.uploaders) == 1
    first, second = pool.servers
    pool.copies[(first.receiver, "v3")] = "/received/v3"
    # A server that needs v3 (taken back after the upload) uses the receiver's copy: no second upload.
    assert pool.receiver_copy(second.receiver, str(tmp_path), "v3") == "/received/v3"
    with pytest.raises(ConfigError, match="lists a server twice"):
        VLLMServer(server_urls=["http://127.0.0.1:1", "http://127.0.0.1:1/"]).check()


def test_a_receiver_that_misses_an_upload_loses_its_record_of_that_tag(tmp_path, monkeypatch):
    from lit_rl.rollout.server.pool import ServerPool

    config = VLLMServer(
        server_urls=["http://10.0.0.2:8000", "http://10.0.0.3:8000"],
        transfer=WeightTransfer(receiver_urls=["http://10.0.0.2:8010", "http://10.0.0.3:8010"]),
    )
    monkeypatch.setattr(WeightUploader, "upload", lambda self, directory, tag: f"{self.url}/{tag}")
    pool = ServerPool(config)
    pool.upload(str(tmp_path), "current")
    assert pool.copies == {(s.receiver, "current"): f"{s.receiver}/current" for s in pool.servers}
    pool.servers[1].in_service = False  # out while the next push goes up: its receiver keeps the older weights
    pool.upload(str(tmp_path), "current")
    assert list(pool.copies) == [(pool.servers[0].receiver, "current")]
    # Taken back, it gets an upload of its own instead of the older copy.
    uploads = []
    monkeypatch.setattr(WeightUploader, "upload", lambda self, directory, tag: uploads.append(self.url) or "new")
    assert pool.receiver_copy(pool.servers[1].receiver, str(tmp_path), "current") == "new"
    assert uploads == [pool.servers[1].receiver]
