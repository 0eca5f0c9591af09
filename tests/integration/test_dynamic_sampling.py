"""`--model.rollout.dynamic_sampling true` (GRPO) through the real CLI: refills happen, the step trains on informative
groups, the checkpoint cadence and exact resume hold with refills, and the chosen batch is the same on 1 and 2
ranks."""

from __future__ import annotations

import pytest

from tests.conftest import (
    FAST_GRPO,
    assert_rows_match,
    fit_config,
    fit_in_subprocess,
    saved_steps,
    train_rows,
    without_engine_gap,
)

pytestmark = pytest.mark.slow

# The shipped model answers most tiny-task prompts right, so many groups of 4 are all correct (zero std).
DYNAMIC = [
    "--model.rollout.dynamic_sampling",
    "true",
    "--model.rollout.max_refill_generations",
    "3",
    "--model.optim.learning_rate",
    "1e-3",
]


def test_dynamic_sampling_refills_and_trains_on_groups_whose_rewards_differ(tmp_path):
    plain = train_rows(fit_config(tmp_path, "plain", "grpo.yaml", *FAST_GRPO, "--trainer.max_steps", "3"))
    rows = train_rows(fit_config(tmp_path, "dynamic", "grpo.yaml", *FAST_GRPO, *DYNAMIC, "--trainer.max_steps", "3"))
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert any(row["train/frac_reward_zero_std"] > 0 for row in plain)  # without it, steps hold useless groups
    assert any(row["train/refill_generations"] > 0 for row in rows)
    assert any(row["train/frac_groups_dropped"] > 0 for row in rows)
    assert all(0 <= row["train/frac_groups_dropped"] < 1 for row in rows)
    for row in rows:
        if row["train/refill_generations"] < 3:  # the refills filled the batch: every group informative
            assert row["train/frac_reward_zero_std"] == 0, row


def test_dynamic_sampling_keeps_the_checkpoint_cadence_and_resumes_exactly(tmp_path):
    full = fit_config(tmp_path, "full", "grpo.yaml", *FAST_GRPO, *DYNAMIC, "--trainer.max_steps", "4", every_n=2)
    assert saved_steps(full) == [2, 4]
    resumed = fit_config(
        tmp_path,
        "resumed",
        "grpo.yaml",
        *FAST_GRPO,
        *DYNAMIC,
        "--trainer.max_steps",
        "4",
        "--ckpt_path",
        str(full / "checkpoints" / "step=2.ckpt"),
        every_n=2,
    )
    assert saved_steps(resumed) == [4]
    rows = train_rows(resumed)
    assert [row["step"] for row in rows] == [3, 4]
    assert any(row["train/refill_generations"] > 0 for row in train_rows(full))
    assert_rows_match(rows, train_rows(full), rel=0, abs=0)


def _layout(tmp_path, devices: int, accumulate: int):
    log_dir = fit_in_subprocess(
        tmp_path,
        f"dynamic_{devices}x{accumulate}",
        "grpo.yaml",
        *FAST_GRPO,
        *DYNAMIC,
        "--model.schedule.micro_batch_size",
        str(8 // (devices * accumulate)),
        "--trainer.devices",
        str(devices),
        "--trainer.accumulate_grad_batches",
        str(accumulate),
        "--trainer.max_steps",
        "3",
        "--trainer.limit_val_batches",
        "0",
        *(["--trainer.strategy", "ddp"] if devices > 1 else []),
        every_n_train_steps=None,
    )
    return without_engine_gap(train_rows(log_dir))


def test_dynamic_sampling_chooses_the_same_batch_on_one_and_two_ranks(tmp_path):
    # Groups of 4 over ranks of 4 completions each: which groups are kept is decided over all ranks' rewards.
    reference = _layout(tmp_path, 1, 2)
    assert any(row["train/refill_generations"] > 0 for row in reference)
    assert_rows_match(_layout(tmp_path, 2, 1), reference, rel=1e-5, abs=1e-6)
