"""PPO through the real CLI: per-stage metrics, validation isolation, the exact checkpoint cadence, exact resume
with the critic in the checkpoint, and the critic exported next to the policy (by the callback and by
`lit_rl.export`)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import (
    CONFIGS,
    FAST_GRPO,
    assert_rows_match,
    read_metrics,
    run_cli,
    saved_steps,
    train_rows,
    write_overlay,
)

pytestmark = pytest.mark.slow

PPO = str(CONFIGS / "ppo.yaml")
PROBES = "tests.integration.probes."
# Large steps (and beta > 0: the reference and the old log-probs run) so that any difference shows.
FAST_PPO = [
    *FAST_GRPO,
    "--model.loss.beta",
    "0.05",
    "--model.optim.learning_rate",
    "1e-3",
    "--model.critic_learning_rate",
    "1e-2",
]


def _fit(tmp_path, *args, every_n=None, name="a"):
    overlay = write_overlay(tmp_path / f"{name}.yaml", every_n_train_steps=every_n, save_dir=tmp_path / name)
    run_cli("fit", "--config", PPO, "--config", str(overlay), *FAST_PPO, *args)
    return tmp_path / name / "run" / "version_0"


def test_ppo_logs_its_metrics_per_stage_and_validation_does_not_change_training(tmp_path):
    sampled = ("--model.sampling.val_temperature", "1", "--model.sampling.val_num_generations", "4")
    probe = ("--trainer.callbacks+", PROBES + "RecordRngAcrossValidation")
    probe += ("--trainer.callbacks.directory", str(tmp_path / "probe"))
    with_val = _fit(tmp_path, "--trainer.max_steps", "4", "--trainer.val_check_interval", "2", *sampled, *probe)
    without = _fit(tmp_path, "--trainer.max_steps", "4", "--trainer.limit_val_batches", "0", name="noval")
    rows = read_metrics(with_val)
    columns = set(rows[0])
    for name in (
        "reward",
        "loss",
        "policy_loss",
        "kl",
        "clip_ratio",
        "entropy",
        "critic/value_loss",
        "critic/value_clip_ratio",
        "critic/values",
        "critic/returns",
        "critic/explained_variance",
    ):
        assert f"train/{name}" in columns, name
    for row in rows:  # each row is one stage
        stages = {k.split("/")[0] for k, v in row.items() if v != "" and "/" in k and not k.startswith("perf/")}
        assert len(stages) == 1, row
    assert [float(r["step"]) for r in rows if r.get("val/reward")] == [2.0, 4.0]
    train = train_rows(with_val)
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert train[0]["train/critic/values"] == 0.0 and train[-1]["train/critic/values"] != 0.0  # the critic learns
    assert train[0]["train/kl"] == 0.0 and train[-1]["train/kl"] > 0  # the policy moves from the reference
    for row in train:  # the loss is its two parts
        expected = row["train/policy_loss"] + 0.1 * row["train/critic/value_loss"]
        assert row["train/loss"] == pytest.approx(expected, rel=1e-5, abs=1e-7)
    validations = json.loads((tmp_path / "probe" / "rng_rank0.json").read_text())["validations"]
    assert validations == [{"step": 2, "unchanged": True}, {"step": 4, "unchanged": True}]
    assert train == train_rows(without)


@pytest.mark.parametrize("accumulate, num_iterations, steps_per_generation", [(2, 2, 1), (1, 2, 2)])
def test_ppo_checkpoint_cadence_is_exact(tmp_path, accumulate, num_iterations, steps_per_generation):
    log_dir = _fit(
        tmp_path,
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


def test_ppo_resumes_mid_generation_exactly_with_its_critic_and_exports_it(tmp_path):
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
    export = ("--trainer.callbacks+", "lit_rl.callbacks.SaveHFPretrained")
    full = _fit(tmp_path, "--trainer.max_steps", "6", *common, *export, every_n=3, name="full")
    first = _fit(tmp_path, "--trainer.max_steps", "3", *common, every_n=3, name="first")
    checkpoint = first / "checkpoints" / "step=3.ckpt"
    state = torch.load(checkpoint, weights_only=True)["state_dict"]
    assert any(key.startswith("critic.model.") for key in state) and state["critic.score.weight"].abs().max() > 0
    resumed = _fit(tmp_path, "--trainer.max_steps", "6", *common, "--ckpt_path", str(checkpoint), every_n=3, name="r")
    assert saved_steps(full) == [3, 6] and saved_steps(resumed) == [6]
    rows = train_rows(resumed)
    assert [r["step"] for r in rows] == [4, 5, 6]
    assert_rows_match(rows, train_rows(full), abs=1e-6)

    # The callback's hf/critic and `lit_rl.export`'s critic of the step-6 checkpoint hold the same weights.
    from safetensors.torch import load_file

    from lit_rl.export import export_checkpoint

    exported = export_checkpoint(full / "checkpoints" / "step=6.ckpt", tmp_path / "exported")
    at_end = load_file(full / "hf" / "critic" / "model.safetensors")
    from_checkpoint = load_file(exported / "critic" / "model.safetensors")
    assert set(at_end) == set(from_checkpoint) and "score.weight" in at_end
    for key, value in at_end.items():
        assert torch.equal(value, from_checkpoint[key]), key
