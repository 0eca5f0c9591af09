"""`model.rollout.engine.transfer.method: gloo` without a vLLM server: stdlib servers in threads play its HTTP side,
and the receiving end is lit-rl's real vLLM engine (`lit_rl.rollout.in_server.vllm_transfer_plugin`) joining the
trainer's gloo group as vLLM's workers do. Checked: the weights that arrive, the order of the calls (resumed only after
the finish), the chunks, failures (left paused, taken out or the run stopped), a server without the engine, and the
config checks."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from lit_rl.errors import ConfigError
from lit_rl.rollout import VLLMServer, WeightTransfer
from lit_rl.rollout.engines.vllm_server import RolloutServerError, VLLMServerEngine
from lit_rl.rollout.server.collective_transfer import weight_chunks
from tests.fake_vllm import completions_answer

pytest.importorskip("vllm")
from lit_rl.rollout.in_server.vllm_transfer_plugin import GlooWeightTransferEngine, UpdateBudget  # noqa: E402

WEIGHTS = [("model.embed_tokens.weight", torch.randn(6, 4)), ("model.norm.weight", torch.randn(4))]
WEIGHTS += [(f"model.layers.{i}.mlp.weight", torch.randn(8, 4, dtype=torch.bfloat16)) for i in range(3)]


class FakeWorker:
    """One vLLM server with one worker: its HTTP answers, and lit-rl's gloo engine receiving into `loaded`.
    `fail_update`: the `/update_weights` call (counting from 1) that fails with a 500 before receiving."""

    def __init__(self, fail_update: int = 0, has_engine: bool = True) -> None:
        self.loaded: list[tuple[str, torch.Tensor]] = []
        self.chunks: list[list[str]] = []
        self.fail_update = fail_update
        self.has_engine = has_engine
        self.active = False
        engine = object.__new__(GlooWeightTransferEngine)  # what vLLM's worker builds, minus the model
        engine.parallel_config = SimpleNamespace(data_parallel_index=0, world_size=1, rank=0)
        engine.model = torch.nn.ParameterList([torch.nn.Parameter(tensor) for _, tensor in WEIGHTS])
        engine.model.load_weights = lambda pairs: self.loaded.extend(pairs)
        engine.device = torch.device("cpu")
        engine.group = None
        self.engine = engine

    def __call__(self, path, body):
        # The worker's update session as vLLM keeps it (`_weight_update_active`): begun by a start, ended by a
        # finish or by an update that fails inside the worker.
        if path == "/collective_rpc":
            return {"results": [None]} if self.has_engine else (500, {"error": "Weight transfer not configured"})
        if path == "/get_world_size?include_dp=true":
            return {"world_size": 1}
        if path == "/init_weight_transfer_engine":
            self.engine.init_transfer_engine(self.engine.parse_init_info(body["init_info"]))
            return {}
        if path == "/start_weight_update":
            if self.active:
                return (500, {"error": "start_weight_update called while a weight update is already active"})
            self.active = True
            self.engine.budget = UpdateBudget(self.engine.model, shards=1)  # as the engine's start_weight_update
            return {}
        if path == "/update_weights":
            if not self.active:
                return (500, {"error": "start_weight_update must be called before update_weights"})
            try:
                info = self.engine.parse_update_info(body["update_info"])
            except ValueError as err:
                self.active = False
                return (500, {"error": str(err)})
            self.chunks.append(info.names)
            if len(self.chunks) == self.fail_update:
                self.active = False
                return (500, {"error": "worker died"})
            self.engine.receive_weights(info)
            return {}
        if path == "/finish_weight_update":
            if not self.active:
                return (500, {"error": "finish_weight_update called without a matching start_weight_update"})
            self.active = False
            return {}
        return completions_answer(path, body)


def _engine(servers, **config):
    urls = [s.url for s in servers]
    config = {"request_timeout_s": 20.0, **config}
    vllm = VLLMServer(server_urls=urls, max_retries=0, transfer=WeightTransfer(method="gloo"), **config)
    vllm.check()
    return VLLMServerEngine(vllm, eos_token_ids=[2], pad_token_id=0)


def _calls(server):
    return [path for _, path, _ in server.requests if path not in ("/health", "/v1/models", "/v1/completions")]


def test_the_weights_are_broadcast_in_chunks_between_pause_and_resume(fake_server):
    workers = [FakeWorker(), FakeWorker()]
    servers = [fake_server((200, worker, 0)) for worker in workers]
    engine = _engine(servers, push_bucket_mib=160 / 2**20)  # chunks of 160 bytes: 96 + 16, then 64 + 64, then 64
    engine.update_weights(iter(WEIGHTS))
    for worker, server in zip(workers, servers):
        assert [name for name, _ in worker.loaded] == [name for name, _ in WEIGHTS]
        for (_, got), (_, sent) in zip(worker.loaded, WEIGHTS):
            assert got.dtype == sent.dtype and torch.equal(got, sent)
        assert worker.chunks == [
            ["model.embed_tokens.weight", "model.norm.weight"],
            ["model.layers.0.mlp.weight", "model.layers.1.mlp.weight"],
            ["model.layers.2.mlp.weight"],
        ]
        updates = ["/update_weights"] * 3
        assert _calls(server) == [
            "/collective_rpc",  # at connect: its workers have the engine...
            "/get_world_size?include_dp=true",  # ...and this many of them
            "/update_weights",  # malformed: ends an update an earlier trainer left unfinished (here none)
            "/shutdown_weight_transfer_engine",
            "/init_weight_transfer_engine",
            "/pause?mode=wait",
            "/start_weight_update",
            *updates,
            "/finish_weight_update",
            "/reset_prefix_cache",
            "/resume",
        ]
    # A second push reuses the groups.
    engine.update_weights(iter([(name, tensor + 1) for name, tensor in WEIGHTS]))
    assert torch.equal(workers[0].loaded[-1][1], WEIGHTS[-1][1] + 1)
    assert _calls(servers[1]).count("/init_weight_transfer_engine") == 1


def test_an_update_left_unfinished_by_an_earlier_trainer_is_ended_before_the_first_push(fake_server):
    worker = FakeWorker()
    worker.active = True  # its last trainer died between start and finish
    engine = _engine([fake_server((200, worker, 0))])
    engine.update_weights(iter(WEIGHTS))
    assert [name for name, _ in worker.loaded] == [name for name, _ in WEIGHTS] and not worker.active


def test_a_server_failing_mid_transfer_is_left_paused_taken_out_and_back_whole_at_the_next_push(fake_server, caplog):
    good, bad = FakeWorker(), FakeWorker(fail_update=2)
    servers = [fake_server((200, good, 0)), fake_server((200, bad, 0))]
    engine = _engine(servers, on_server_failure="continue", push_bucket_mib=160 / 2**20)
    with caplog.at_level(logging.WARNING, logger="lit_rl.rollout.server.pool"):
        engine.update_weights(iter(WEIGHTS))
    assert len(good.loaded) == len(WEIGHTS) and _calls(servers[0])[-1] == "/resume"
    # Half-loaded: never resumed, never finished, and no later chunk sent.
    assert "/resume" not in _calls(servers[1]) and "/finish_weight_update" not in _calls(servers[1])
    assert len(bad.chunks) == 2
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 1 and servers[1].url in warnings[0] and "left paused" in warnings[0]
    assert "worker died" in warnings[0] and "\n" not in warnings[0]
    # It still answers /health: the next push forms its group again and gives it every weight, then resumes it.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lit_rl.rollout.server.pool"):
        engine.update_weights(iter(WEIGHTS))
    assert len(good.loaded) == 2 * len(WEIGHTS) and len(bad.chunks) == 2 + 3
    assert [name for name, _ in bad.loaded[-len(WEIGHTS) :]] == [name for name, _ in WEIGHTS]
    assert _calls(servers[1]).count("/init_weight_transfer_engine") == 2 and _calls(servers[1])[-1] == "/resume"
    assert [record.getMessage() for record in caplog.records] == [
        f"vLLM server {servers[1].url} answers again: back in service with the current weights"
    ]


def test_a_server_back_without_its_engine_stays_out_and_the_run_goes_on(fake_server, caplog):
    good, bad = FakeWorker(), FakeWorker(fail_update=1)
    servers = [fake_server((200, good, 0)), fake_server((200, bad, 0))]
    engine = _engine(servers, on_server_failure="continue")
    engine.update_weights(iter(WEIGHTS))  # `bad` fails and is taken out
    bad.has_engine = False  # restarted without --weight-transfer-config
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lit_rl.rollout.server.pool"):
        engine.update_weights(iter(WEIGHTS))
    assert len(good.loaded) == 2 * len(WEIGHTS) and caplog.records == []
    assert [server.url for server in engine.pool.in_service()] == [servers[0].url]


def test_by_default_a_failed_transfer_stops_the_run_in_one_line(fake_server):
    server = fake_server((200, FakeWorker(fail_update=1), 0))
    engine = _engine([server])
    with pytest.raises(RolloutServerError, match="the weight transfer failed") as info:
        engine.update_weights(iter(WEIGHTS))
    assert server.url in str(info.value) and "\n" not in str(info.value)
    assert "/resume" not in _calls(server)


def test_a_server_without_the_engine_is_refused_before_training_saying_how_to_start_it(fake_server):
    server = fake_server((200, FakeWorker(has_engine=False), 0))
    with pytest.raises(RolloutServerError) as info:
        _engine([server])
    message = str(info.value)
    assert server.url in message and '--weight-transfer-config \'{"backend": "lit_rl_gloo"}\'' in message
    assert "\n" not in message


def test_chunks_are_copies_that_outlive_the_stream():
    source = [("a", torch.ones(4)), ("b", torch.ones(2, 2).t()), ("c", torch.ones(100))]
    chunks = list(weight_chunks(iter(source), chunk_bytes=32, device=torch.device("cpu")))
    assert [[name for name, _ in chunk] for chunk in chunks] == [["a", "b"], ["c"]]  # a chunk at most 32 bytes...
    for _, tensor in source:  # ...unless one tensor is larger
        tensor.zero_()
    assert all(bool((t == 1).all()) and t.is_contiguous() for chunk in chunks for _, t in chunk)
    # Owned (a staged version's host copies): a contiguous tensor on the device goes as it is, once; others are copied.
    owned = [("a", torch.ones(4)), ("b", torch.ones(2, 2).t())]
    (chunk,) = weight_chunks(iter(owned), chunk_bytes=64, device=torch.device("cpu"), owned=True)
    assert chunk[0][1] is owned[0][1] and chunk[1][1] is not owned[1][1] and chunk[1][1].is_contiguous()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            {"transfer": {"receiver_url": "http://10.0.0.2:8010"}},
            "model.rollout.engine.transfer.receiver_url(s) is for transfer.method: http",
        ),
        ({"transfer": {"port": 70000}}, "model.rollout.engine.transfer.port must be in 0..65535"),
        (
            {"transfer": {"port": 65535}, "server_urls": ["http://127.0.0.1:1", "http://127.0.0.1:2"]},
            "no port for each",
        ),
        ({"server_url": "http://10.0.0.2:8000"}, "set model.rollout.engine.transfer.address to this machine's address"),
        ({"transfer": {"address": "0.0.0.0"}}, "model.rollout.engine.transfer.address must be this machine's address"),
    ],
)
def test_bad_transfer_settings_are_refused_in_one_line_naming_the_key(settings, message):
    transfer = WeightTransfer(method="gloo", **settings.get("transfer", {}))
    with pytest.raises(ConfigError) as info:
        VLLMServer(**{**settings, "transfer": transfer}).check()
    assert message in str(info.value)


def test_asynchronous_generations_broadcast_each_staged_version_once_to_every_server(fake_server):
    from tests.test_server_pool import MASK, PARAMS, PROMPTS

    workers = [FakeWorker(), FakeWorker()]
    servers = [fake_server((200, worker, 0)) for worker in workers]
    engine = _engine(servers)
    weights = [(name, tensor.clone()) for name, tensor in WEIGHTS]
    for version in (1, 1, 2):
        if version not in engine._staged:
            engine.stage_weights(iter(weights), version)
            staged = [tensor.clone() for _, tensor in weights]
            for _, tensor in weights:
                tensor.add_(1)  # the next optimizer step: the staged copy must not follow it
        engine.collect(engine.submit(PROMPTS, MASK, PARAMS, seeds=list(range(8)), version=version))
        for worker in workers:
            assert all(torch.equal(got, want) for (_, got), want in zip(worker.loaded[-len(WEIGHTS) :], staged))
    engine.close()
    for worker, server in zip(workers, servers):
        assert len(worker.loaded) == 2 * len(WEIGHTS)  # versions 1 and 2, once each
        assert _calls(server).count("/resume") == 2
    assert list(engine._staged) == []  # version 1 went once 2 was loaded; close() dropped 2


def test_a_version_whose_host_copies_fail_is_still_streamed_to_its_end(fake_server, monkeypatch):
    """Under ZeRO-3 the stream gathers each parameter from every rank: a rank 0 that stopped reading it after a
    failed copy would leave the other ranks in the next gather, so it reads the rest before the error goes on."""
    from lit_rl.rollout.engines import vllm_server

    engine = _engine([fake_server((200, FakeWorker(), 0))])
    read = []

    def stream():
        for name, tensor in WEIGHTS:
            read.append(name)
            yield name, tensor

    def copies_fail(named_tensors):
        next(iter(named_tensors))
        raise MemoryError("no host memory for the copies")

    monkeypatch.setattr(vllm_server, "host_copies", copies_fail)
    with pytest.raises(RolloutServerError, match="MemoryError: no host memory for the copies"):  # on every rank
        engine.stage_weights(stream(), 1)
    assert read == [name for name, _ in WEIGHTS] and 1 not in engine._staged
    engine.close()


def test_vllm_finds_the_gloo_engine_through_the_installed_plugin_entry_point():
    from importlib.metadata import entry_points

    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    (plugin,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "lit_rl_gloo"]
    register = plugin.load()
    register()
    register()  # vLLM may load its plugins more than once in a process
    assert WeightTransferEngineFactory._registry["lit_rl_gloo"]() is GlooWeightTransferEngine


def test_nccl_is_refused_in_one_line_on_a_trainer_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="transfer.method: nccl needs a CUDA GPU beside the trainer; use gloo"):
        VLLMServer(transfer=WeightTransfer(method="nccl")).check()
