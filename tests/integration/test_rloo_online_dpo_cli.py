"""RLOO and Online DPO through the real CLI: metric names, exact checkpoint cadence, resume with the same cadence."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import (
    CONFIGS,
    FAST_GRPO,
    assert_rows_match,
    build_tiny_reward_model,
    read_metrics,
    run_cli,
    saved_steps,
    train_rows,
    write_overlay,
)

pytestmark = pytest.mark.slow

ALGORITHMS = {
    "rloo": ["--model.sampling.num_generations", "4"],
    "online_dpo": ["--model.sampling.num_generations", "2"],
}
FAST = [arg for arg in FAST_GRPO]
FAST[FAST.index("--model.sampling.num_generations") + 1] = "2"  # overridden per algorithm below


def _fit(tmp_path, algorithm, *args, every_n=None, name="a"):
    overlay = write_overlay(tmp_path / f"{name}.yaml", every_n_train_steps=every_n, save_dir=tmp_path / name)
    run_cli(
        "fit",
        "--config",
        str(CONFIGS / f"{algorithm}.yaml"),
        "--config",
        str(overlay),
        *FAST,
        *ALGORITHMS[algorithm],
        *args,
    )
    return tmp_path / name / "run" / "version_0"


@pytest.mark.parametrize(
    "algorithm, expected",
    [
        ("rloo", ["reward", "loss", "completion_length", "kl", "advantage_std", "clip_ratio", "rewards/correctness"]),
        (
            "online_dpo",
            [
                "reward",
                "loss",
                "completion_length",
                "frac_tied_pairs",
                "rewards/chosen",
                "rewards/rejected",
                "rewards/accuracies",
                "rewards/margins",
                "logps/chosen",
            ],
        ),
    ],
)
def test_metrics_are_logged_per_stage(tmp_path, algorithm, expected):
    log_dir = _fit(
        tmp_path,
        algorithm,
        "--trainer.max_steps",
        "3",
        "--trainer.val_check_interval",
        "3",
        "--model.schedule.micro_batch_size",
        "16",
    )
    rows = read_metrics(log_dir)
    columns = set(rows[0])
    for name in expected:
        assert f"train/{name}" in columns, name
    for name in ("reward", "completion_length", "rewards/correctness"):
        assert f"val/{name}" in columns, name
    train = train_rows(log_dir)
    assert [r["step"] for r in train] == [1, 2, 3]
    if algorithm == "rloo":
        assert train[0]["train/kl"] == 0.0  # the policy is the reference until the first update
    else:
        assert all(0.0 <= r["train/frac_tied_pairs"] <= 1.0 for r in train)
        # Step 1 has an untied pair (this seed's), whose margin is 0: the policy is still the reference.
        assert train[0]["train/frac_tied_pairs"] < 1.0
        assert train[0]["train/rewards/margins"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("algorithm", ["rloo", "online_dpo"])
@pytest.mark.parametrize("accumulate, num_iterations, steps_per_generation", [(2, 2, 1), (1, 2, 2), (2, 1, 2)])
def test_checkpoint_cadence_is_exact(tmp_path, algorithm, accumulate, num_iterations, steps_per_generation):
    log_dir = _fit(
        tmp_path,
        algorithm,
        "--trainer.max_steps",
        "8",
        "--trainer.accumulate_grad_batches",
        str(accumulate),
        "--model.schedule.num_iterations",
        str(num_iterations),
        "--model.schedule.steps_per_generation",
        str(steps_per_generation),
        "--model.schedule.micro_batch_size",
        "4",
        every_n=4,
    )
    assert saved_steps(log_dir) == [4, 8]
    assert [r["step"] for r in train_rows(log_dir)] == list(range(1, 9))


@pytest.mark.parametrize("algorithm", ["rloo", "online_dpo"])
def test_resume_mid_generation_keeps_cadence_and_global_step(tmp_path, algorithm):
    common = (
        "--trainer.accumulate_grad_batches",
        "2",
        "--model.schedule.num_iterations",
        "2",
        "--model.schedule.steps_per_generation",
        "2",
        "--model.schedule.micro_batch_size",
        "2",
    )
    full = _fit(tmp_path, algorithm, "--trainer.max_steps", "6", *common, every_n=3, name="full")
    first = _fit(tmp_path, algorithm, "--trainer.max_steps", "3", *common, every_n=3, name="first")
    resumed = _fit(
        tmp_path,
        algorithm,
        "--trainer.max_steps",
        "6",
        *common,
        "--ckpt_path",
        str(first / "checkpoints" / "step=3.ckpt"),
        every_n=3,
        name="resumed",
    )
    assert saved_steps(full) == [3, 6] and saved_steps(resumed) == [6]
    checkpoint = torch.load(resumed / "checkpoints" / "step=6.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 6
    rows = train_rows(resumed)
    assert [r["step"] for r in rows] == [4, 5, 6]
    assert_rows_match(rows, train_rows(full), abs=1e-6, nan_ok=True)
    # checkpoints.md: the final weights agree too (step 6's update is logged by no row above).
    final_full = torch.load(full / "checkpoints" / "step=6.ckpt", weights_only=True)["state_dict"]
    assert sorted(checkpoint["state_dict"]) == sorted(final_full)
    for key, value in checkpoint["state_dict"].items():
        assert torch.allclose(value, final_full[key], atol=1e-6), key


def test_online_dpo_with_a_reward_model_judge(tmp_path):
    build_tiny_reward_model(tmp_path / "rm")
    log_dir = _fit(
        tmp_path,
        "online_dpo",
        "--trainer.max_steps",
        "2",
        "--trainer.limit_val_batches",
        "0",
        "--model.rewards.funcs",
        "[]",
        "--model.rewards.weights",
        "null",
        "--model.reward_model_name_or_path",
        str(tmp_path / "rm"),
    )
    rows = train_rows(log_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert "train/rewards/reward_model" in rows[0]
    assert rows[0]["train/frac_tied_pairs"] < 1.0  # continuous scores rank (almost) every pair
