"""The colocated vLLM engine without vLLM: where rank r of W puts its engine, what it asks vLLM for, and the order
of sleep mode's calls (a recording fake in place of `vllm.LLM`). The real engine runs in tests/integration."""

import itertools
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from lit_rl.errors import ConfigError
from lit_rl.rollout import RolloutOutput, SamplingParams, VLLMColocate
from lit_rl.rollout.engines import vllm as vllm_module
from lit_rl.rollout.engines.placement import EnginePlacement, tp_slice
from lit_rl.rollout.engines.vllm import VLLMColocateEngine, engine_kwargs
from lit_rl.training.perf import StepTimer
from tests.conftest import fit_grpo


@pytest.mark.parametrize(
    "rank, local_rank, world, per_node, tp, group, tp_ranks",
    [
        (0, 0, 1, 1, 1, 0, [0]),
        (5, 5, 8, 8, 1, 5, [5]),  # one engine per rank, on the rank's own GPU
        (5, 5, 8, 8, 2, 2, [4, 5]),
        (6, 2, 8, 4, 4, 1, [4, 5, 6, 7]),  # 2 nodes of 4: rank 6 is GPU 2 of node 1
        (3, 3, 8, 8, 8, 0, list(range(8))),
    ],
)
def test_placement_of_rank_r_of_w(rank, local_rank, world, per_node, tp, group, tp_ranks):
    placement = EnginePlacement(rank, local_rank, world, per_node, tp)
    groups = placement.all_tp_groups()
    assert (placement.tp_group, groups[placement.tp_group], placement.tp_rank) == (
        group,
        tp_ranks,
        tp_ranks.index(rank),
    )
    assert placement.engine_seed == group  # the members of one engine sample alike
    assert sorted(r for g in groups for r in g) == list(range(world))
    env = placement.environment("10.0.0.1", 29500)
    assert env["RANK"] == str(rank) and env["LOCAL_RANK"] == str(local_rank) and env["WORLD_SIZE"] == str(world)


@pytest.mark.parametrize(
    "world, per_node, tp, message",
    [
        (2, 2, 4, "tensor_parallel_size=4 must divide the 2 trainer ranks"),
        (6, 6, 4, "tensor_parallel_size=4 must divide the 6 trainer ranks"),
        (8, 2, 4, "must divide the 2 ranks per node: a tensor-parallel engine cannot span nodes"),
    ],
)
def test_placement_rejects_tp_groups_that_do_not_fit(world, per_node, tp, message):
    with pytest.raises(ConfigError, match=message):
        EnginePlacement(0, 0, world, per_node, tp)


def test_each_member_keeps_its_own_rows_of_the_group_request():
    assert [tp_slice([3, 2, 4], r) for r in range(3)] == [slice(0, 3), slice(3, 5), slice(5, 9)]


def test_engine_arguments_of_rank_r_use_the_external_launcher():
    placement = EnginePlacement(5, 1, 8, 4, tensor_parallel_size=2)
    config = VLLMColocate(gpu_memory_utilization=0.4, enable_sleep_mode=True, tensor_parallel_size=2)
    kwargs = engine_kwargs(config, "/models/qwen", "bfloat16", placement, on_gpu=True)
    assert kwargs["distributed_executor_backend"] == "external_launcher"
    assert kwargs["tensor_parallel_size"] == 2 and kwargs["seed"] == 2
    assert kwargs["dtype"] == "bfloat16" and kwargs["enable_sleep_mode"] is True
    assert kwargs["load_format"] == "dummy" and kwargs["trust_remote_code"] is False
    assert kwargs["enforce_eager"] is False  # CUDA graphs on GPU
    assert engine_kwargs(VLLMColocate(), "m", "float32", EnginePlacement(0, 0, 1, 1), on_gpu=False)["enforce_eager"]


class RecordingLLM:
    """Stands in for `vllm.LLM`: records every call, answers each request with two tokens."""

    def __init__(self):
        self.calls = []

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags)))

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def collective_rpc(self, method, kwargs):
        names = [name for name, _ in kwargs["weights_iterator"]]  # consumed, as vLLM does
        self.calls.append((method, len(names)))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))
        return self.reset_succeeds

    reset_succeeds = True  # vLLM: False while KV blocks are still held

    def generate(self, requests, sampling, use_tqdm=False):
        assert [s[1] for s in sampling] == [1, 2] and all("prompt_token_ids" in r for r in requests)
        self.calls.append(("generate", len(requests)))
        step = {5: SimpleNamespace(logprob=-0.5), 2: SimpleNamespace(logprob=-0.25)}
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[5, 2], logprobs=[step, step])]) for _ in requests]


@pytest.fixture(autouse=True)
def no_vllm_import(monkeypatch):
    """vLLM is never imported in the test process (it binds threads): sampling settings stay lit-rl's."""
    monkeypatch.setattr(vllm_module, "vllm_sampling_params", lambda params, seed, eos: (params, seed))


def _sleeping_engine():
    timer = StepTimer()
    llm = RecordingLLM()
    engine = VLLMColocateEngine(llm, VLLMColocate(enable_sleep_mode=True), [2], 0, phase=timer.phase)
    return engine, llm, timer


PROMPTS = (torch.tensor([[0, 4, 5], [7, 8, 9]]), torch.tensor([[0, 1, 1], [1, 1, 1]]))


def test_sleep_mode_wakes_weights_then_pushes_then_wakes_the_cache_then_generates_then_sleeps():
    engine, llm, timer = _sleeping_engine()
    weights = [("a", torch.zeros(2)), ("b", torch.ones(2))]
    engine.update_weights(iter(weights))  # just started: awake, nothing to wake
    out = engine.generate(*PROMPTS, SamplingParams(max_new_tokens=2), seeds=[1, 2])
    assert out.completion_ids.tolist() == [[5, 2], [5, 2]] and out.logprobs.tolist() == [[-0.5, -0.25]] * 2
    engine.generate(*PROMPTS, SamplingParams(max_new_tokens=2), seeds=[1, 2])  # e.g. a second validation batch
    engine.sleep()
    assert not engine.holds_weights  # level 2 released them
    assert [call[0] for call in llm.calls] == ["reload_weights", "reset_prefix_cache", "generate", "generate", "sleep"]
    llm.calls.clear()
    engine.update_weights(iter(weights))
    engine.generate(*PROMPTS, SamplingParams(max_new_tokens=2), seeds=[1, 2])
    engine.sleep()
    engine.sleep()  # asleep already: nothing more
    assert llm.calls == [
        ("wake_up", ("weights",)),
        ("reload_weights", 2),
        ("reset_prefix_cache",),
        ("wake_up", ("kv_cache",)),
        ("generate", 2),
        ("sleep", 2),
    ]
    perf = timer.summary()
    assert perf["perf/engine_wake_s"] > 0 and perf["perf/engine_sleep_s"] > 0


def test_a_slept_engine_refuses_to_generate_before_a_push():
    engine, llm, _ = _sleeping_engine()
    engine.update_weights([("a", torch.zeros(2))])
    engine.generate(*PROMPTS, SamplingParams(max_new_tokens=2), seeds=[1, 2])
    engine.sleep()
    with pytest.raises(RuntimeError, match="push weights first"):
        engine.generate(*PROMPTS, SamplingParams(max_new_tokens=2), seeds=[1, 2])
    assert llm.calls[-1] == ("sleep", 2)  # nothing was woken or generated


def test_without_sleep_mode_the_engine_never_sleeps_or_wakes():
    llm = RecordingLLM()
    engine = VLLMColocateEngine(llm, VLLMColocate(), [2], 0)
    for _ in range(2):
        engine.update_weights([("a", torch.zeros(2))])
        engine.generate(*PROMPTS, SamplingParams(max_new_tokens=2), seeds=[1, 2])
        engine.sleep()
    assert [call[0] for call in llm.calls] == ["reload_weights", "reset_prefix_cache", "generate"] * 2


def test_a_refused_prefix_cache_reset_stops_the_push_instead_of_reusing_the_old_weights_cache():
    llm = RecordingLLM()
    llm.reset_succeeds = False
    engine = VLLMColocateEngine(llm, VLLMColocate(), [2], 0)
    with pytest.raises(RuntimeError, match="refused to reset its prefix cache"):
        engine.update_weights([("a", torch.zeros(2))])
    assert [call[0] for call in llm.calls] == ["reload_weights", "reset_prefix_cache"]


class FakeClock:
    """`time.perf_counter` that moves only when told: phase times become known numbers."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now

    def advance(self, seconds):
        self.now += seconds


def test_phases_are_measured_and_nested_ones_count_once(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr("lit_rl.training.perf.time.perf_counter", clock)
    timer = StepTimer()
    clock.advance(0.5)  # before any phase: policy update
    with timer.phase("weight_push"):
        clock.advance(2.0)
        with timer.phase("engine_wake"):
            clock.advance(1.0)
        clock.advance(0.25)
    with timer.phase("generation"):
        clock.advance(3.0)
    with timer.phase("generation"):  # a phase entered twice in a step adds up
        clock.advance(1.0)
    clock.advance(0.75)
    perf = timer.summary()
    assert perf["perf/step_s"] == 8.5
    assert perf["perf/weight_push_s"] == 2.25  # its own time, without the wake inside it
    assert perf["perf/engine_wake_s"] == 1.0
    assert perf["perf/generation_s"] == 4.0
    assert perf["perf/policy_update_s"] == 1.25  # the time outside every phase
    assert perf["perf/reward_s"] == 0.0  # every phase is logged, 0 when it did not happen
    clock.advance(2.0)
    assert timer.summary()["perf/step_s"] == 2.0  # the next step starts where the previous summary was taken


class SleepingFakeEngine:
    """An engine that needs weights and releases them when told to sleep (as vLLM's sleep level 2 does)."""

    needs_weights = True

    def __init__(self):
        self.calls = []
        self.holds_weights = False

    def update_weights(self, named_tensors):
        assert len(list(named_tensors)) > 0
        self.calls.append("push")
        self.holds_weights = True

    def generate(self, prompt_ids, prompt_mask, params, seeds=None):
        self.calls.append("generate")
        n = len(prompt_ids)
        return RolloutOutput(torch.full((n, 2), 5), torch.ones(n, 2), torch.full((n, 2), -0.5))

    def sleep(self):
        self.calls.append("sleep")
        self.holds_weights = False

    def close(self):
        pass


def test_the_module_sleeps_the_engine_after_a_rollout_and_pushes_again_after():
    model = fit_grpo()
    fake = SleepingFakeEngine()
    model.engines.built, model.engines.weights_step = fake, None
    model.engines.engine()
    model.engines.engine()
    assert fake.calls == ["push"]  # same global_step, weights still held: one push
    rows = [{"prompt": "1+2=", "answer": "3"}] * 8
    model.make_rollout(model.producer.generation(0, rows))
    assert fake.calls == ["push", "generate", "sleep"]  # asleep before the log-prob forwards and the update
    model.make_rollout(model.producer.generation(1, rows))
    assert fake.calls == ["push", "generate", "sleep", "push", "generate", "sleep"]  # woken by a push


class SteppingLLM(RecordingLLM):
    """Stands in for `vllm.LLM` and its engine as independent episodes use them: a request whose prompt ends in k
    finishes after k engine steps, answering `[10 + k, 2]`. Records the requests running in each step; `hold_step`
    (1-based) makes that step wait for `release` before it returns."""

    def __init__(self, hold_step=None):
        super().__init__()
        self.request_counter = itertools.count()
        self.llm_engine = self
        self.steps_left: dict[str, int] = {}
        self.k: dict[str, int] = {}
        self.batches: list[list[str]] = []
        self.aborted: list[str] = []
        self.hold_step, self.holding, self.release = hold_step, threading.Event(), threading.Event()
        self.fail_step = None

    def add_request(self, request_id, prompt, params):
        assert prompt["type"] == "token"  # rendered, as `LLM.generate` renders it (a raw prompt is deprecated)
        if prompt["prompt_token_ids"][-1] == 0:
            raise ValueError("planted: the prompt is longer than max_model_len")
        self.steps_left[request_id] = self.k[request_id] = prompt["prompt_token_ids"][-1]

    def has_unfinished_requests(self):
        return bool(self.steps_left)

    def step(self):
        self.batches.append(sorted(self.steps_left, key=int))
        if len(self.batches) == self.hold_step:
            self.holding.set()
            assert self.release.wait(10)
        if len(self.batches) == self.fail_step:
            raise RuntimeError("planted: vLLM's step failed")
        outputs = []
        for request_id in list(self.steps_left):
            self.steps_left[request_id] -= 1
            if self.steps_left[request_id] == 0:
                del self.steps_left[request_id]
                outputs.append(_finished(request_id, self.k[request_id]))
        return outputs

    def abort_request(self, request_ids):
        self.aborted.extend(request_ids)
        for request_id in request_ids:
            self.steps_left.pop(request_id, None)

    def generate(self, requests, sampling, use_tqdm=False):
        return [_finished("0", r["prompt_token_ids"][-1]) for r in requests]


def _finished(request_id, k):
    steps = {10 + k: SimpleNamespace(logprob=-0.5), 2: SimpleNamespace(logprob=-0.25)}
    completion = SimpleNamespace(token_ids=[10 + k, 2], logprobs=[steps, steps])
    return SimpleNamespace(request_id=request_id, finished=True, outputs=[completion])


def _turn(engine, k, results):
    prompt = (torch.tensor([[1, k]]), torch.ones(1, 2, dtype=torch.long))
    try:
        results[k] = engine.concurrent_generate(*prompt, SamplingParams(max_new_tokens=2), seeds=[k])
    except Exception as err:  # what the episode's thread would raise
        results[k] = err


def _threads(engine, ks, results):
    threads = [threading.Thread(target=_turn, args=(engine, k, results)) for k in ks]
    for thread in threads:
        thread.start()
    return threads


def _until(condition):
    deadline = time.monotonic() + 10
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.001)


def _release_once_a_call_waits_alone(engine, llm):
    """Let the held step return once a call made alone (`generate`, `close`) waits for it, from another thread."""
    threading.Thread(target=lambda: _until(lambda: engine.steps.alone_waiting) or llm.release.set()).start()


def test_turns_from_many_threads_join_one_running_batch_of_vllms_scheduler():
    """Issue 56.1 on the colocated engine: turns sent from episodes' threads go into vLLM's own scheduler. A turn
    that arrives while another is decoding joins the next engine step (it does not wait for the other to finish),
    each thread gets its own request's output, and the engine steps only as often as the longest turn needs."""
    llm = SteppingLLM(hold_step=2)
    engine = VLLMColocateEngine(llm, VLLMColocate(), [2], 0)
    results = {}
    (long_turn,) = _threads(engine, [6], results)  # 6 steps
    assert llm.holding.wait(10)  # its second step is running: two short turns arrive meanwhile
    late = _threads(engine, [2, 3], results)
    _until(lambda: len(engine.steps.queued) == 2)
    llm.release.set()
    for thread in (long_turn, *late):
        thread.join(10)
    assert {k: out.completion_ids.tolist() for k, out in results.items()} == {6: [[16, 2]], 2: [[12, 2]], 3: [[13, 2]]}
    running = [sorted(llm.k[request_id] for request_id in batch) for batch in llm.batches]  # each by its k
    assert running == [[6], [6], [2, 3, 6], [2, 3, 6], [3, 6], [6]]
    assert engine.steps.in_vllm == {} and engine.steps.queued == []


def test_a_generate_after_abandoned_turns_aborts_them_and_their_threads_end():
    """An episode's turn abandoned mid-sampling (its run stopped by a failure or Ctrl-C): the next call made alone
    (the next rollout's `generate`, a push) waits for the step under way, aborts the abandoned requests in vLLM
    (else `LLM.generate` would collect their outputs as its own), and the abandoned thread ends with an error."""
    llm = SteppingLLM(hold_step=1)
    engine = VLLMColocateEngine(llm, VLLMColocate(), [2], 0)
    results = {}
    (abandoned,) = _threads(engine, [5], results)
    assert llm.holding.wait(10)
    _release_once_a_call_waits_alone(engine, llm)
    out = engine.generate(*PROMPTS, SamplingParams(max_new_tokens=2), seeds=[1, 2])  # waits for the step
    abandoned.join(10)
    assert out.completion_ids.tolist() == [[15, 2], [19, 2]]
    assert llm.aborted == ["0"] and llm.batches == [["0"]]
    assert isinstance(results[5], RuntimeError) and "stopped this turn's requests" in str(results[5])


def test_a_request_vllm_refuses_fails_its_own_caller_alone():
    """A turn vLLM will not take (a transcript past `max_model_len`) fails the episode that sent it, whichever thread
    was stepping; the other turns queued with it are sampled."""
    llm = SteppingLLM(hold_step=1)
    engine = VLLMColocateEngine(llm, VLLMColocate(), [2], 0)
    results = {}
    (first,) = _threads(engine, [3], results)
    assert llm.holding.wait(10)
    late = _threads(engine, [0, 2], results)  # queued while the first step runs: one refused, one taken
    _until(lambda: len(engine.steps.queued) == 2)
    llm.release.set()
    for thread in (first, *late):
        thread.join(10)
    assert "planted: the prompt is longer than max_model_len" in str(results[0])
    assert results[2].completion_ids.tolist() == [[12, 2]] and results[3].completion_ids.tolist() == [[13, 2]]
    assert engine.steps.in_vllm == {} and engine.steps.queued == []


def test_a_failed_step_fails_every_turn_waiting_and_to_come():
    """vLLM's step raising leaves the engine broken: the turns waiting get the error, later ones too, at once."""
    llm = SteppingLLM(hold_step=1)
    llm.fail_step = 1
    engine = VLLMColocateEngine(llm, VLLMColocate(), [2], 0)
    results = {}
    (first,) = _threads(engine, [3], results)
    assert llm.holding.wait(10)
    (second,) = _threads(engine, [4], results)  # queued: waits for the next step, which never comes
    _until(lambda: len(engine.steps.queued) == 1)
    llm.release.set()
    for thread in (first, second):
        thread.join(10)
    assert "planted: vLLM's step failed" in str(results[3]) and "planted: vLLM's step failed" in str(results[4])
    with pytest.raises(RuntimeError, match="closed or failed"):
        engine.concurrent_generate(torch.tensor([[1, 2]]), torch.ones(1, 2), SamplingParams(max_new_tokens=2))
    assert llm.batches == [["0"]]


def test_closing_the_engine_ends_the_turns_waiting_and_its_thread():
    llm = SteppingLLM(hold_step=1)
    engine = VLLMColocateEngine(llm, VLLMColocate(), [2], 0)
    results = {}
    (waiting,) = _threads(engine, [4], results)
    assert llm.holding.wait(10)
    closing = threading.Thread(target=engine.close)
    closing.start()  # waits for the step under way, then none is made
    _release_once_a_call_waits_alone(engine, llm)
    for thread in (waiting, closing):
        thread.join(10)
    assert "stopped this turn's requests (closed)" in str(results[4]) and llm.batches == [["0"]]
    assert engine.llm is None and engine.steps.llm is None and not engine.steps.thread.is_alive()


def test_a_turn_from_a_thread_wakes_a_sleeping_cache_and_a_tensor_parallel_engine_takes_none():
    """On several ranks each rank's first turns come from its episodes' threads too: the first of them wakes the
    cache of an engine that slept (its weights woken by the push before)."""
    llm = SteppingLLM()
    engine = VLLMColocateEngine(llm, VLLMColocate(enable_sleep_mode=True), [2], 0)
    engine.sleep()
    with pytest.raises(RuntimeError, match="push weights first"):
        engine.concurrent_generate(*PROMPTS, SamplingParams(max_new_tokens=2), seeds=[1, 2])
    engine.update_weights([("a", torch.zeros(2))])
    out = engine.concurrent_generate(torch.tensor([[1, 2]]), torch.ones(1, 2), SamplingParams(max_new_tokens=2))
    assert out.completion_ids.tolist() == [[12, 2]]
    assert [call[0] for call in llm.calls] == ["sleep", "wake_up", "reload_weights", "reset_prefix_cache", "wake_up"]
    engine.tp_group = object()
    with pytest.raises(RuntimeError, match="tensor-parallel colocated engine samples its group's turns together"):
        engine.concurrent_generate(*PROMPTS, SamplingParams(max_new_tokens=2), seeds=[1, 2])
