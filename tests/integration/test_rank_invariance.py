"""Rank invariance: one global batch per optimizer step split as 1 process x 4 micro-batches, 2 x 2 and 4 x 1
must log the same per-step loss and metrics (the loss and every metric are normalised over the whole step).
For GRPO that also needs the same completions in every layout (each is sampled with a seed of its place in the
global batch, `RolloutProducer.completion_seeds`, not from its rank's random stream) and group statistics over
the whole group when a group spans ranks (4 x 1 below, run where a group can span ranks). GRPO runs with beta > 0
and each of the four loss aggregations, whose denominators are counts over all ranks and micro-batches, and with
asynchronous rollouts (max_staleness 1: every rank's generations sampled ahead by a background engine, then
corrected by the engine's log-probs)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import FAST_GRPO, assert_rows_match, fit_in_subprocess, train_rows, without_engine_gap

pytestmark = pytest.mark.slow

LAYOUTS = [(1, 4), (2, 2), (4, 1)]  # (processes, micro-batches per process per step)


def _dpo(tmp_path, devices: int, accumulate: int):
    log_dir = fit_in_subprocess(
        tmp_path,
        f"dpo_{devices}x{accumulate}",
        "dpo.yaml",
        "--trainer.devices",
        str(devices),
        "--trainer.accumulate_grad_batches",
        str(accumulate),
        "--data.batch_size",
        "2",  # 2 pairs per micro-batch: 8 pairs per optimizer step in every layout
        "--trainer.max_steps",
        "3",
        "--trainer.limit_val_batches",
        "0",
        "--data.val_data",
        "null",
        "--model.optim.learning_rate",
        "1e-3",  # large steps: layouts that disagreed on a gradient would drift apart by step 3
        *(["--trainer.strategy", "ddp"] if devices > 1 else []),
        every_n_train_steps=None,
    )
    return train_rows(log_dir)


def test_dpo_steps_are_the_same_in_every_layout(tmp_path):
    """1 x 4 and 2 x 2: the pairs' count is summed over ranks and micro-batches. DPO has no groups to span ranks, so
    4 x 1 (4 processes, the costliest run) would check the same sums once more."""
    runs = {layout: _dpo(tmp_path, *layout) for layout in LAYOUTS[:2]}
    reference = runs[(1, 4)]
    assert [row["step"] for row in reference] == [1, 2, 3]
    for layout, rows in runs.items():
        assert [row["step"] for row in rows] == [1, 2, 3], layout
        assert_rows_match(rows, reference, rel=1e-5, abs=1e-6)


def _grpo(tmp_path, aggregation: str, devices: int, accumulate: int, *extra: str, tag: str = ""):
    name = f"grpo{tag}_{aggregation}_{devices}x{accumulate}"
    log_dir = fit_in_subprocess(
        tmp_path,
        name,
        "grpo.yaml",
        *FAST_GRPO,
        "--trainer.devices",
        str(devices),
        "--trainer.accumulate_grad_batches",
        str(accumulate),
        "--model.sampling.num_generations",
        "8",
        "--model.schedule.micro_batch_size",
        "4",  # 16 completions (2 prompts x 8) per optimizer step; in the 4 x 1 layout each group spans 2 ranks
        "--model.loss.beta",
        "0.04",
        "--model.loss.aggregation",
        aggregation,
        "--trainer.max_steps",
        "3",
        "--trainer.limit_val_batches",
        "0",
        "--model.optim.learning_rate",
        "1e-3",
        "--trainer.callbacks+",
        "tests.integration.probes.RecordCompletionTokens",
        "--trainer.callbacks.directory",
        str(tmp_path / name / "probe"),
        *(["--trainer.strategy", "ddp"] if devices > 1 else []),
        *extra,
        every_n_train_steps=None,
    )
    tokens = [
        json.loads((tmp_path / name / "probe" / f"tokens_rank{rank}.json").read_text())["tokens_per_step"]
        for rank in range(devices)
    ]
    return without_engine_gap(train_rows(log_dir)), tokens


@pytest.fixture(scope="module")
def grpo_layout(tmp_path_factory):
    """`_grpo(aggregation, processes, micro-batches)` without extra flags, run once per module: the 1 x 4 `token`
    run is both a layout of `test_grpo_steps_are_the_same_in_every_layout[token]` and the reference of
    `test_token_budgeted_grpo_steps_are_the_same_in_every_layout`."""
    runs: dict = {}

    def run(aggregation: str, devices: int, accumulate: int):
        key = (aggregation, devices, accumulate)
        if key not in runs:
            runs[key] = _grpo(tmp_path_factory.mktemp("grpo"), *key)
        return runs[key]

    return run


@pytest.mark.parametrize("aggregation", ["sequence", "token", "constant", "dapo"])
def test_grpo_steps_are_the_same_in_every_layout(grpo_layout, aggregation):
    """`token`, `constant` and `dapo` divide by counts summed over ranks (tokens, sequences); a rank that used
    its own counts would weigh its tokens differently from the 1-process run, which the unequal completion
    lengths across ranks (checked) make visible. `sequence` and `constant` run on 1 and 2 processes only: every
    rank holds the same number of sequences, so their denominators cannot tell the layouts apart, and groups
    spanning ranks (4 x 1, the costliest run: 4 processes) are checked with `token` and `dapo`."""
    layouts = LAYOUTS if aggregation in ("token", "dapo") else LAYOUTS[:2]
    runs = {layout: grpo_layout(aggregation, *layout) for layout in layouts}
    reference, _ = runs[(1, 4)]
    assert [row["step"] for row in reference] == [1, 2, 3]
    assert reference[-1]["train/kl"] > 0  # the policy moved: later steps sample from updated weights
    for layout, (rows, tokens) in runs.items():
        assert [row["step"] for row in rows] == [1, 2, 3], layout
        if layout[0] > 1:  # the ranks' completions differ in length: their token counts differ at some step
            assert any(len(set(per_rank)) > 1 for per_rank in zip(*tokens, strict=True)), (layout, tokens)
        assert_rows_match(rows, reference, rel=1e-5, abs=1e-6)


# max_staleness 1 on each rank's background engine: the probe replaces the engine (no server is contacted) with one
# that samples from a snapshot of the weights of the version it is given.
ASYNC_SNAPSHOT = [
    "--model.rollout.engine",
    "VLLMServer",  # accepted for max_staleness > 0
    "--model.rollout.max_staleness",
    "1",
    "--trainer.callbacks+",
    "tests.integration.probes.UseSnapshotEngine",
]


def test_grpo_steps_with_asynchronous_rollouts_are_the_same_in_every_layout(tmp_path):
    """max_staleness 1: generation g is sampled on each rank's background engine with the weights of step g - 1
    while step g - 1 trains; the old log-probs are then the current policy's and `token_truncate` weighs them
    against the engine's. Seeds, staleness, corrections and denominators must not depend on the layout."""
    runs = {layout: _grpo(tmp_path, "token", *layout, *ASYNC_SNAPSHOT, tag="_async") for layout in LAYOUTS}
    reference, _ = runs[(1, 4)]
    assert [row["train/staleness/max"] for row in reference] == [0.0, 1.0, 1.0]
    assert reference[-1]["train/kl"] > 0
    for layout, (rows, _) in runs.items():
        assert [row["step"] for row in rows] == [1, 2, 3], layout
        assert_rows_match(rows, reference, rel=1e-5, abs=1e-6)


def test_dynamic_sampling_with_asynchronous_rollouts_is_the_same_on_one_and_two_processes(tmp_path):
    """GRPO's dynamic sampling with max_staleness 1: a generation sampled ahead is judged when it is taken, on every
    rank together, and the refills are sampled then by the step's weights. Which groups are kept, how many refill
    generations a step takes, their seeds, the staleness of each row and the denominators must not depend on the
    layout."""
    extra = [*ASYNC_SNAPSHOT, "--model.rollout.dynamic_sampling", "true", "--model.rollout.max_refill_generations", "3"]
    runs = {layout: _grpo(tmp_path, "token", *layout, *extra, tag="_async_refill") for layout in LAYOUTS[:2]}
    reference, _ = runs[(1, 4)]
    assert any(row["train/refill_generations"] > 0 for row in reference), reference  # refills were sampled
    for layout, (rows, _) in runs.items():
        assert [row["step"] for row in rows] == [1, 2, 3], layout
        assert_rows_match(rows, reference, rel=1e-5, abs=1e-6)


def test_token_budgeted_grpo_steps_are_the_same_in_every_layout(tmp_path, grpo_layout):
    """`micro_batch_tokens` (padding-free) on 1 and 2 processes: the step's completions are dealt so the ranks'
    tokens even out, each rank groups its share by tokens and runs empty micro-steps where they fit in fewer
    micro-batches; the step is the fixed layout's."""
    budget = ["--model.schedule.micro_batch_tokens", "64", "--model.policy.padding_free", "true"]
    reference, _ = grpo_layout("token", 1, 4)
    for layout in [(1, 4), (2, 2)]:
        rows, _ = _grpo(tmp_path, "token", *layout, *budget, tag="_budget")
        assert [row["step"] for row in rows] == [1, 2, 3], layout
        assert all(row.pop("train/micro_batch_tokens/max") <= 64 for row in rows)
        spread = [row.pop("train/rank_tokens/max") - row.pop("train/rank_tokens/min") for row in rows]
        if layout[0] == 1:
            assert spread == [0, 0, 0]
        else:  # 8 completions of 9-12 tokens per rank: dealt, 0, 1 and 0 tokens apart (each rank its own: 16, 1, 8)
            assert all(0 <= gap <= 2 for gap in spread), spread
        assert_rows_match(rows, reference, rel=1e-4, abs=1e-5)


def _ppo(tmp_path, devices: int, accumulate: int):
    name = f"ppo_{devices}x{accumulate}"
    log_dir = fit_in_subprocess(
        tmp_path,
        name,
        "ppo.yaml",
        *FAST_GRPO,
        "--trainer.devices",
        str(devices),
        "--trainer.accumulate_grad_batches",
        str(accumulate),
        "--model.sampling.num_generations",
        "2",
        "--model.schedule.micro_batch_size",
        "4",  # 16 completions (8 prompts x 2) per optimizer step
        "--model.loss.beta",
        "0.05",
        "--model.schedule.num_iterations",
        "2",  # the second pass clips the ratio and the values
        "--trainer.max_steps",
        "3",
        "--trainer.limit_val_batches",
        "0",
        "--model.optim.learning_rate",
        "1e-3",
        "--model.critic_learning_rate",
        "1e-2",
        *(["--trainer.strategy", "ddp"] if devices > 1 else []),
        every_n_train_steps=None,
    )
    return without_engine_gap(train_rows(log_dir))


def test_ppo_steps_are_the_same_in_every_layout(tmp_path):
    """PPO: the critic's values, GAE and the advantages whitened with moments summed over ranks, and token-mean
    policy and value losses over the whole step, are the same however the step is split: 1 x 4 and 2 x 2 (PPO
    has no groups to span ranks; 4 x 1 would check the same sums over ranks once more)."""
    runs = {layout: _ppo(tmp_path, *layout) for layout in LAYOUTS[:2]}
    reference = runs[(1, 4)]
    assert [row["step"] for row in reference] == [1, 2, 3]
    assert reference[-1]["train/kl"] > 0 and reference[-1]["train/critic/values"] != 0  # both networks moved
    for layout, rows in runs.items():
        assert [row["step"] for row in rows] == [1, 2, 3], layout
        assert_rows_match(rows, reference, rel=1e-5, abs=1e-6)
