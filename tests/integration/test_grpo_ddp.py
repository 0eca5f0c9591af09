"""GRPO on 2 CPU processes (DDP over gloo): cadence, per-rank rollout state in checkpoints, exact resume."""

from __future__ import annotations

import pytest

from tests.conftest import (
    CONFIGS,
    FAST_GRPO,
    assert_rows_match,
    fit_in_subprocess,
    read_metrics,
    saved_steps,
    train_rows,
)

pytestmark = pytest.mark.slow


def _ddp_fit(tmp_path, name, *args):
    return fit_in_subprocess(
        tmp_path,
        name,
        "grpo.yaml",
        "--config",
        str(CONFIGS / "strategy" / "ddp.yaml"),  # the overlay users add: 2 processes, DDP
        *FAST_GRPO,
        "--model.schedule.num_iterations",
        "2",
        "--model.schedule.micro_batch_size",
        "4",
        "--model.schedule.steps_per_generation",
        "2",
        *args,
    )


def test_two_process_grpo_resumes_mid_generation_exactly(tmp_path):
    # 2 steps per generation x 2 iterations: the step-2 checkpoint is in the middle of a generation, with a
    # different rollout buffer and RNG stream on each rank.
    full = _ddp_fit(
        tmp_path, "full", "--trainer.max_steps", "6", "--trainer.val_check_interval", "4", "--data.val_limit", "7"
    )
    assert saved_steps(full) == [2, 4, 6]
    val = [r for r in read_metrics(full) if r.get("val/reward")]
    assert len(val) >= 1  # 7 validation prompts over 2 ranks: one rank's share is padded, with weight 0
    resumed = _ddp_fit(
        tmp_path,
        "resumed",
        "--trainer.max_steps",
        "6",
        "--trainer.limit_val_batches",
        "0",
        "--ckpt_path",
        str(full / "checkpoints" / "step=2.ckpt"),
    )
    assert saved_steps(resumed) == [4, 6]
    rows = train_rows(resumed)
    assert [r["step"] for r in rows] == [3, 4, 5, 6]
    assert_rows_match(rows, train_rows(full), abs=1e-6)
