"""Model FLOPs (`lit_rl.training.flops`): the count against a hand count and against torch's own FLOP counter, the
rows' tokens and keys by hand, and `perf/tflops`, `perf/mfu`, `perf/update_mfu` and the summary line of a real run."""

from __future__ import annotations

import csv
import subprocess
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import Qwen2ForCausalLM

from lit_rl.modeling.lora import LoRAConfig, apply_lora
from lit_rl.modeling.models import tiny_qwen2_config
from lit_rl.training.flops import ModelShape, Peak, RunThroughput, device_peak, row_tokens_and_keys
from tests.conftest import REPO, cli_env, grouped_kwargs


def _model(**config) -> torch.nn.Module:
    torch.manual_seed(0)
    # GQA (2 key/value heads for 4 query heads) and an MLP wider than the hidden size: every term differs.
    shape = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=384)
    config = tiny_qwen2_config(**{**shape, **config})
    config._attn_implementation = "eager"  # attention as matmuls, which torch's FLOP counter counts
    return Qwen2ForCausalLM(config)


def test_the_shape_is_the_hand_count():
    h, heads, kv, d, inner, vocab, layers = 256, 4, 2, 64, 384, 320, 4
    per_layer = h * heads * d + 2 * h * kv * d + heads * d * h + 3 * h * inner  # q, k and v, o, gate/up/down
    shape = ModelShape.of(_model())
    assert shape == ModelShape(layers * per_layer + h * vocab, layers * per_layer + h * vocab, layers, heads * d)
    # One sequence of 10 tokens: 2 N per token, and 4 L d_attn per key of the 1 + 2 + ... + 10 = 55.
    assert shape.forward_flops(10, 55) == 2 * shape.matmul_params * 10 + 4 * layers * heads * d * 55


@pytest.mark.parametrize("lora", [False, True])
def test_forward_and_backward_agree_with_torch_flop_counter(lora):
    """torch counts every matmul it runs, and attention over the full T x T scores (it does not know the mask is
    causal): the matmul terms must agree exactly, attention by the causal share (T + 1) / 2T."""
    model = _model()
    if lora:
        model = apply_lora(model, LoRAConfig(r=8))
    shape = ModelShape.of(model)
    T = 12
    ids = torch.randint(0, 256, (1, T))
    attention_full = 4 * shape.layers * shape.attention_width * T * T  # forward, as torch counts it
    with FlopCounterMode(display=False) as forward:
        logits = model(ids).logits
    assert forward.get_total_flops() - attention_full == shape.forward_flops(T, 0)
    with FlopCounterMode(display=False) as backward:
        logits.float().logsumexp(-1).sum().backward()
    counted = backward.get_total_flops() - 2 * attention_full
    if lora:
        # Nothing before the first layer needs a gradient with frozen embeddings: autograd skips the gradient of
        # layer 0's inputs (its q/k/v and the adapters on them), which the count includes.
        assert 0.9 * shape.backward_flops(T, 0) < counted < shape.backward_flops(T, 0)
        assert shape.trained_matmul_params < 0.1 * shape.matmul_params
    else:
        assert counted == shape.backward_flops(T, 0) == 2 * shape.forward_flops(T, 0)
    causal_keys = T * (T + 1) / 2
    assert shape.forward_flops(0, causal_keys) == attention_full * (T + 1) / (2 * T)


def test_rows_count_each_distinct_prompt_once_and_each_completion_token_at_its_position():
    # Prompts A A B (left-padded to 3), completions of 2, 1 and 3 tokens.
    prompt_ids = torch.tensor([[5, 6, 7], [5, 6, 7], [0, 8, 9]])
    prompt_mask = torch.tensor([[1, 1, 1], [1, 1, 1], [0, 1, 1]])
    completion_mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.float32)
    tokens, keys = row_tokens_and_keys(prompt_ids, prompt_mask, completion_mask)
    assert tokens == 3 + 2 + (2 + 1 + 3)  # A, B, then the completions
    # A: 1+2+3, B: 1+2; row 0: positions 3, 4 -> 4+5; row 1: 4; row 2: positions 2, 3, 4 -> 3+4+5
    assert keys == 6 + 3 + 9 + 4 + 12


def test_the_update_counts_the_training_passes_alone():
    """`perf/update_mfu` divides the FLOPs of the passes that train (forward and backward) by the update's time:
    a generation's or an old log-prob pass's forward counts in the step's FLOPs only."""
    from types import SimpleNamespace

    from lit_rl.algorithms.base import PolicyModule
    from lit_rl.training.perf import StepTimer

    shape = ModelShape.of(_model())
    module = SimpleNamespace(timer=StepTimer(), policy_shape=shape)
    prompt_ids, prompt_mask = torch.tensor([[5, 6, 7]]), torch.ones(1, 3, dtype=torch.long)
    completion_mask = torch.ones(1, 4)
    tokens, keys = row_tokens_and_keys(prompt_ids, prompt_mask, completion_mask)
    PolicyModule.count_flops(module, prompt_ids, prompt_mask, completion_mask)  # e.g. the old log-probs
    PolicyModule.count_flops(module, prompt_ids, prompt_mask, completion_mask, backward=True)  # the training pass
    forward, backward = shape.forward_flops(tokens, keys), shape.backward_flops(tokens, keys)
    assert module.timer.counters["model_flops"] == 2 * forward + backward
    assert module.timer.counters["update_flops"] == forward + backward


def test_a_gpu_missing_from_the_table_and_a_cpu_are_measured():
    peak = device_peak(torch.device("cpu"), torch.float32)
    assert peak.source == "measured cpu matmul, float32" and peak.flops > 1e9
    run = RunThroughput(peak=Peak(1e12, "test"), devices=2)
    run.add(2.0, 1e12)
    run.add(2.0, 3e12)
    assert run.tflops() == 1.0 and run.mfu() == 0.5
    assert run.summary() == "2 s/step, 1 TFLOP/s, MFU 50% (of test peak 1 TFLOP/s x 2 devices)"
    # A launched server's 23 s in the first step: left out of the speed, and said.
    launched = RunThroughput(peak=Peak(1e12, "test"))
    launched.add(25.0, 1e12, engine_start_s=23.0)
    launched.add(2.0, 3e12, engine_start_s=0.0)
    assert launched.summary() == (
        "2 s/step, 1 TFLOP/s, MFU 100% (of test peak 1 TFLOP/s); the engine's start (23 s) left out"
    )


def test_a_run_logs_tflops_and_mfu_every_step_and_the_summary_says_them(tmp_path):
    command = [sys.executable, "-m", "lit_rl.cli", "fit", "--config", str(REPO / "configs" / "grpo.yaml")]
    overrides = ["--trainer.max_steps", "3", "--trainer.val_check_interval", "null", "--trainer.default_root_dir", "."]
    result = subprocess.run(
        [*command, *overrides], cwd=tmp_path, capture_output=True, text=True, timeout=600, env=cli_env()
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (metrics,) = tmp_path.glob("runs/**/metrics.csv")
    rows = [row for row in csv.DictReader(metrics.open()) if row.get("perf/tflops")]
    assert len(rows) == 3
    for row in rows:
        assert float(row["perf/tflops"]) > 0 and 0 < float(row["perf/mfu"]) < 1
        assert 0 < float(row["perf/update_mfu"]) < 1
        assert float(row["perf/mfu"]) == pytest.approx(
            float(row["perf/tflops"]) / float(rows[0]["perf/tflops"]) * float(rows[0]["perf/mfu"]), rel=1e-6
        )
    speed = next(line for line in result.stdout.splitlines() if line.strip().startswith("speed"))
    assert "TFLOP/s, MFU" in speed and "of measured cpu matmul, float32 peak" in speed, speed


def test_validation_between_two_steps_is_left_out_of_the_next_steps_time():
    """Validation through Lightning's own hooks (`on_validation_start` / `_end` pause and resume the step clock):
    after every training batch a validation that takes at least 2 s (its two batches sleep 1 s each) runs; every
    step's `perf/step_s` stays at a step's time, well under it."""
    import time

    import lightning as L

    from lit_rl.algorithms import GRPO
    from lit_rl.data import PromptDataModule
    from tests.conftest import quiet_trainer

    class SlowValidation(L.Callback):
        def on_validation_batch_end(self, *args, **kwargs):
            time.sleep(1.0)

    class StepTimes(L.Callback):
        def __init__(self):
            self.times = []

        def on_train_batch_end(self, trainer, *args):
            if len(self.times) < trainer.global_step and "perf/step_s" in trainer.callback_metrics:
                self.times.append(float(trainer.callback_metrics["perf/step_s"]))

    args = dict(num_generations=4, micro_batch_size=8, max_new_tokens=4, temperature=1.0)
    model = GRPO(**grouped_kwargs(GRPO, **args))
    steps = StepTimes()
    trainer = quiet_trainer(
        max_steps=3,
        val_check_interval=1,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        callbacks=[SlowValidation(), steps],
    )
    L.seed_everything(0)
    started = time.monotonic()
    trainer.fit(model, PromptDataModule())
    assert time.monotonic() - started > 4  # validation ran after steps 1 and 2, 2 s each
    assert len(steps.times) == 3
    assert max(steps.times) < 1.5, steps.times  # a step is well under a second here; with validation, 2 s more


def test_the_step_clock_stops_while_validation_runs():
    import time

    from lit_rl.training.perf import StepTimer

    timer = StepTimer()
    timer.pause()
    time.sleep(0.2)  # validation between two steps
    timer.resume()
    assert timer.summary()["perf/step_s"] < 0.1


def test_a_misnamed_step_counter_fails_instead_of_logging_nothing():
    from lit_rl.training.perf import COUNTERS, StepTimer

    timer = StepTimer()
    for name in COUNTERS:
        timer.count(name, 1.0)
    with pytest.raises(ValueError, match="no step counter 'generated_token': the counters are generated_tokens, "):
        timer.count("generated_token", 1.0)
    assert dict(timer.counters) == dict.fromkeys(COUNTERS, 1.0)


def test_the_engine_clock_counts_overlapping_requests_once_and_no_validation(monkeypatch):
    """`perf/engine_busy_s`: the seconds with at least one request outstanding, however many overlap; a stretch
    still running counts up to the summary and goes on into the next step; validation's requests count in no step."""
    from lit_rl.training import perf

    now = [0.0]
    monkeypatch.setattr(perf.time, "perf_counter", lambda: now[0])

    def at(t: float, action) -> None:
        now[0] = t
        action()

    clock = perf.BusyClock()
    timer = perf.StepTimer(clock)
    clock.counted = True  # an engine counts on it
    first, second, third = clock.request(), clock.request(), clock.request()
    at(1.0, first.__enter__)  # busy from t=1
    at(2.0, second.__enter__)  # overlapping the first
    at(3.0, lambda: first.__exit__(None, None, None))
    at(4.0, lambda: second.__exit__(None, None, None))  # idle from t=4
    at(5.0, third.__enter__)
    at(6.0, lambda: third.__exit__(None, None, None))
    now[0] = 10.0
    summary = timer.summary()
    assert (summary["perf/step_s"], summary["perf/engine_busy_s"]) == (10.0, 4.0)
    held = clock.request()
    held.__enter__()  # from t=10, still running at the next summary
    now[0] = 12.0
    assert timer.summary()["perf/engine_busy_s"] == 2.0
    at(13.0, timer.pause)  # validation from t=13: the request's second before it is the step's
    at(20.0, lambda: held.__exit__(None, None, None))
    at(21.0, timer.resume)
    now[0] = 22.0
    summary = timer.summary()
    assert (summary["perf/step_s"], summary["perf/engine_busy_s"]) == (2.0, 1.0)
    assert "perf/engine_busy_s" not in perf.StepTimer().summary()  # no engine counting on it: not logged
    assert "perf/engine_busy_s" not in perf.StepTimer(perf.BusyClock()).summary()


def test_token_rates_are_every_ranks_tokens_over_the_slowest_ranks_seconds(monkeypatch):
    """Two ranks: the rates are the run's, all tokens over the seconds the step waited for (not the fastest rank's
    own rate, 200 tokens/s here); with an engine that counts its requests the generation's seconds are its busy
    time, since an asynchronous generation's wait is only the part training did not hide."""
    from lit_rl.training import perf

    now = [0.0]
    monkeypatch.setattr(perf.time, "perf_counter", lambda: now[0])

    def rank(generation_s: float, generated: float, trained: float, busy_s: float = 0.0) -> perf.StepTimer:
        clock = perf.BusyClock()
        timer = perf.StepTimer(clock)
        timer.phases["generation"] = generation_s
        timer.count("generated_tokens", generated)
        timer.count("trained_tokens", trained)
        if busy_s:  # one request outstanding for busy_s of the step
            clock.counted = True
            request = clock.request()
            request.__enter__()
            now[0] = busy_s
            request.__exit__(None, None, None)
            now[0] = 0.0
        return timer

    def step(first: perf.StepTimer, second: perf.StepTimer) -> dict[str, float]:
        now[0] = 4.0  # both ranks' steps: 4 s
        counts = [second.counters[name] for name in COUNTS]  # before its summary, which starts the next step
        other = torch.tensor([*second.summary().values(), *counts], dtype=torch.float64)
        gather = lambda values: torch.stack([values, other])  # noqa: E731
        return perf.step_perf(first, RunThroughput(), gather, torch.device("cpu"))

    COUNTS = ("generated_tokens", "trained_tokens", "model_flops", "update_flops")
    out = step(rank(1.0, 200.0, 400.0), rank(2.0, 300.0, 600.0))
    assert out["perf/step_s"] == 4.0
    assert out["perf/generation_s"] == 2.0  # the slowest rank's
    assert out["perf/generated_tokens_per_s"] == (200 + 300) / 2.0
    assert out["perf/trained_tokens_per_s"] == (400 + 600) / 4.0
    now[0] = 0.0
    hidden = step(rank(0.01, 200.0, 0.0, busy_s=2.5), rank(0.02, 300.0, 0.0, busy_s=3.0))  # asynchronous: waits hidden
    assert hidden["perf/engine_busy_s"] == 3.0
    assert hidden["perf/generated_tokens_per_s"] == (200 + 300) / 3.0  # not 500 / 0.02
    now[0] = 0.0
    assert step(rank(0.0, 0.0, 0.0), rank(0.0, 0.0, 0.0))["perf/generated_tokens_per_s"] == 0.0


def test_the_engine_clock_outlives_the_timers_validation_and_training_start_swap_in(monkeypatch):
    """The module swaps its timer at validation and at the start of training; an engine built under any of them
    (the sanity check's validation builds it first) counts on the module's clock, in every training step after."""
    from types import SimpleNamespace

    from lit_rl.algorithms.base import PolicyModule
    from lit_rl.training import perf

    now = [0.0]
    monkeypatch.setattr(perf.time, "perf_counter", lambda: now[0])
    clock = perf.BusyClock()
    module = SimpleNamespace(engine_clock=clock, timer=perf.StepTimer(clock))
    PolicyModule.on_validation_start(module)  # the sanity check
    clock.counted = True  # the engine is built during it
    with clock.request():
        now[0] = 5.0  # its generations: part of no step
    PolicyModule.on_validation_end(module)
    PolicyModule.start_step_clock(module)  # `on_train_start`
    with clock.request():
        now[0] = 7.0
    PolicyModule.on_validation_start(module)  # a validation between two steps
    assert module.timer.engine is clock
    with clock.request():
        now[0] = 9.0
    PolicyModule.on_validation_end(module)
    now[0] = 10.0
    summary = module.timer.summary()
    assert (summary["perf/step_s"], summary["perf/engine_busy_s"]) == (3.0, 2.0)


def test_a_slow_precision_for_the_device_is_said_in_one_line(monkeypatch):
    from lit_rl.training import flops

    rates = {torch.float32: 2e11, torch.bfloat16: 5e10}  # a CPU without bf16 instructions
    monkeypatch.setattr(flops, "measured_matmul_flops", lambda device_type, dtype: rates[dtype])
    advice = flops.precision_advice(torch.device("cpu"), torch.bfloat16)
    assert advice == (
        "trainer.precision: bfloat16 matmuls run at 50 GFLOP/s on this CPU against 200 in float32 (it has no "
        "bfloat16 instructions): 32-true is faster here"
    )
    rates[torch.bfloat16] = 9e11  # one with them
    assert flops.precision_advice(torch.device("cpu"), torch.bfloat16) is None
    assert flops.precision_advice(torch.device("cpu"), torch.float32) is None
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    advice = flops.precision_advice(torch.device("cuda"), torch.float32)
    assert advice == (
        "trainer.precision: float32 on NVIDIA H100 80GB HBM3, which computes in bfloat16 (its matmul peak is 14.8x "
        "float32's): --config configs/precision/bf16.yaml (bf16-mixed) is faster"
    )
    assert flops.device_peak(torch.device("cuda"), torch.bfloat16) == Peak(989e12, "H100 data sheet, bf16")


def test_the_peak_probe_leaves_the_runs_random_stream_alone():
    """It runs after `seed_everything`: a first run in a process must draw the same samples as a later one."""
    from lit_rl.training.flops import measured_matmul_flops

    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    measured_matmul_flops("cpu", torch.float16, 64, 0.001)
    assert torch.equal(torch.rand(4), expected)
