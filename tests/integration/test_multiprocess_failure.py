"""A multi-process run that fails, as a user meets it: a reward function raises on rank 1 at step 2, under DDP and
under ZeRO-3 (the shipped overlays), through the `lit-rl` script. Exit 1, one `lit-rl: error:` line (rank 0's,
naming the rank that failed), no hang, no abort, no warning, and the step already logged stays on disk."""

from __future__ import annotations

import csv

import pytest

from tests.conftest import CONFIGS
from tests.integration.test_resume import SMALL, _env, _lit_rl

FAILING = """
import os
from lit_rl.rewards.arithmetic import correctness as _correctness
calls = 0
def correctness(prompts, completions, **columns):
    global calls
    calls += 1
    if calls == 2 and os.environ.get("LOCAL_RANK", "0") == "1":
        raise KeyError("answer")
    return _correctness(prompts, completions, **columns)
"""


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "deepspeed_zero3"])
def test_a_reward_that_raises_on_rank_1_ends_every_rank_with_one_line(tmp_path, strategy):
    (tmp_path / "failing.py").write_text(FAILING)
    overlays = ["--config", str(CONFIGS / "strategy" / "ddp.yaml")]  # 2 processes
    if strategy != "ddp":
        overlays += ["--config", str(CONFIGS / "strategy" / f"{strategy}.yaml")]
    result = _lit_rl(
        tmp_path,
        _env(tmp_path),
        *["fit", "--config", str(CONFIGS / "grpo.yaml"), *overlays, *SMALL, "--model.schedule.micro_batch_size", "4"],
        *["--model.rewards.funcs", "[failing.correctness, lit_rl.rewards.arithmetic.integer_format]"],
        *["--trainer.max_steps", "8"],
    )
    assert result.returncode == 1, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("lit-rl: ")]
    # Under DeepSpeed, the run first said how its gradients are clipped (once, from rank 0).
    clipping = [line for line in lines if line.startswith("lit-rl: gradient clipping under DeepSpeed")]
    assert len(clipping) == (0 if strategy == "ddp" else 1), result.stderr[-3000:]
    errors = [line for line in lines if line not in clipping]
    assert errors == ["lit-rl: error: reward function 'correctness' raised KeyError: 'answer' (on rank 1)"], (
        result.stderr[-3000:]
    )
    for noise in ("Traceback", "terminate called", "SIGABRT", "Warning"):
        assert noise not in result.stderr, result.stderr[-3000:]
    with open(tmp_path / "runs" / "grpo" / "version_0" / "metrics.csv", newline="") as handle:
        assert [row["step"] for row in csv.DictReader(handle)] == ["1"]
