"""GRPO through the real CLI on the shipped tiny model: metrics, validation isolation, accumulation, checkpoints."""

from __future__ import annotations

import itertools
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

GRPO = str(CONFIGS / "grpo.yaml")
PROBES = "tests.integration.probes."


def _fit(tmp_path, *args, every_n=None, name="a"):
    overlay = write_overlay(tmp_path / f"{name}.yaml", every_n_train_steps=every_n, save_dir=tmp_path / name)
    run_cli("fit", "--config", GRPO, "--config", str(overlay), *FAST_GRPO, *args)
    return tmp_path / name / "run" / "version_0"


def test_grpo_logs_separate_train_and_val_metrics(tmp_path):
    log_dir = _fit(
        tmp_path, "--trainer.max_steps", "4", "--trainer.val_check_interval", "2", "--model.loss.beta", "0.04"
    )
    rows = read_metrics(log_dir)
    columns = set(rows[0])
    for name in [
        "reward",
        "reward_std",
        "rewards/correctness",
        "rewards/integer_format",
        "loss",
        "kl",
        "entropy",
        "completion_length",
        "clip_ratio/low",
        "clip_ratio/high",
        "frac_reward_zero_std",
        "rollout_logprob_diff/mean",
        "rollout_logprob_diff/max",
    ]:
        assert f"train/{name}" in columns, name
    for name in ["reward", "rewards/correctness", "completion_length"]:
        assert f"val/{name}" in columns, name
    assert not any(c.startswith(("loss", "reward")) for c in columns), "every metric carries its stage prefix"
    # Each row is one stage: no row mixes train/ and val/ values.
    for row in rows:
        stages = {k.split("/")[0] for k, v in row.items() if v != "" and "/" in k and not k.startswith("perf/")}
        assert len(stages) == 1, row
    perf = [r for r in rows if r.get("perf/step_s")]
    assert len(perf) == 4  # one timing row per optimizer step, beside the train/ values
    for name in ("generation_s", "reward_s", "ref_logprobs_s", "policy_update_s", "generated_tokens_per_s"):
        assert float(perf[0][f"perf/{name}"]) >= 0, name
    train = train_rows(log_dir)
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    val_steps = [float(r["step"]) for r in rows if r.get("val/reward")]
    assert val_steps == [2.0, 4.0]
    # The trainer's recomputed log-probs agree with generate's own scores.
    assert max(r["train/rollout_logprob_diff/max"] for r in train) < 1e-4
    assert all(r["train/kl"] >= 0 for r in train)


def test_sampled_validation_does_not_change_training(tmp_path):
    # Validation samples (temperature 1, 4 completions per prompt): it draws from the torch RNG, in a stream of
    # its own. The probe checks that stream's isolation directly (the global RNG state after each validation is
    # the one before it), the logs check that training is unchanged by validation.
    sampled = ("--model.sampling.val_temperature", "1", "--model.sampling.val_num_generations", "4")
    probe = ("--trainer.callbacks+", PROBES + "RecordRngAcrossValidation")
    probe += ("--trainer.callbacks.directory", str(tmp_path / "probe"))
    with_val = _fit(tmp_path, "--trainer.max_steps", "4", "--trainer.val_check_interval", "2", *sampled, *probe)
    without = _fit(tmp_path, "--trainer.max_steps", "4", "--trainer.limit_val_batches", "0", name="noval")
    val = [r for r in read_metrics(with_val) if r.get("val/reward")]
    assert [float(r["step"]) for r in val] == [2.0, 4.0]
    assert all(float(r["val/reward_std"]) > 0 for r in val)  # completions of a prompt differ: it sampled
    validations = json.loads((tmp_path / "probe" / "rng_rank0.json").read_text())["validations"]
    assert validations == [{"step": 2, "unchanged": True}, {"step": 4, "unchanged": True}]
    assert train_rows(with_val) == train_rows(without)


@pytest.mark.parametrize(
    "aggregation, steps_per_generation", [("token", 1), ("sequence", 1), ("dapo", 1), ("dapo", 2), ("token", 2)]
)
def test_accumulation_equals_one_big_micro_batch(tmp_path, aggregation, steps_per_generation):
    """Same global batch as 1 x 8 and 4 x 2 micro-batches: same per-step loss and metrics. With 2 optimizer steps
    per generation the token counts of a step are not the generation's (TRL's DAPO loss was scaled by
    accumulation / steps_per_generation there: huggingface/trl#5619)."""
    common = (
        "--trainer.max_steps",
        "3",
        "--model.loss.aggregation",
        aggregation,
        "--model.schedule.num_iterations",
        "2",
        "--model.schedule.steps_per_generation",
        str(steps_per_generation),
        "--model.loss.beta",
        "0.04",
    )
    one = _fit(tmp_path, *common, "--model.schedule.micro_batch_size", "8", name="one")
    four = _fit(
        tmp_path,
        *common,
        "--model.schedule.micro_batch_size",
        "2",
        "--trainer.accumulate_grad_batches",
        "4",
        name="four",
    )
    a, b = train_rows(one), train_rows(four)
    assert len(a) == len(b) == 3
    assert [r.keys() for r in a] == [r.keys() for r in b]
    assert_rows_match(a, b, abs=1e-5, rel=1e-5)


MATRIX = list(itertools.product([1, 2], [1, 2], [1, 2]))  # accumulate, num_iterations, steps_per_generation


@pytest.mark.parametrize("accumulate, num_iterations, steps_per_generation", MATRIX)
def test_checkpoints_land_exactly_every_n_steps(tmp_path, accumulate, num_iterations, steps_per_generation):
    log_dir = _fit(
        tmp_path,
        "--trainer.max_steps",
        "9",
        "--trainer.accumulate_grad_batches",
        str(accumulate),
        "--model.schedule.num_iterations",
        str(num_iterations),
        "--model.schedule.steps_per_generation",
        str(steps_per_generation),
        "--model.schedule.micro_batch_size",
        "4",
        every_n=3,
    )
    assert saved_steps(log_dir) == [3, 6, 9]
    assert [r["step"] for r in train_rows(log_dir)] == list(range(1, 10))


def test_resume_mid_generation_keeps_cadence_and_metrics(tmp_path):
    # 2 steps per generation x 2 iterations = 4 optimizer steps per generation: step 2 is mid-generation.
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
    full = _fit(tmp_path, "--trainer.max_steps", "8", *common, every_n=2, name="full")
    first = _fit(tmp_path, "--trainer.max_steps", "2", *common, every_n=2, name="first")
    assert saved_steps(first) == [2]
    resumed = _fit(
        tmp_path,
        "--trainer.max_steps",
        "8",
        *common,
        "--ckpt_path",
        str(first / "checkpoints" / "step=2.ckpt"),
        every_n=2,
        name="resumed",
    )
    assert saved_steps(resumed) == [4, 6, 8]
    checkpoint = torch.load(resumed / "checkpoints" / "step=8.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 8
    resumed_rows = train_rows(resumed)
    assert [r["step"] for r in resumed_rows] == [3, 4, 5, 6, 7, 8]
    assert_rows_match(resumed_rows, train_rows(full), abs=1e-6)
    final_full = torch.load(full / "checkpoints" / "step=8.ckpt", weights_only=True)["state_dict"]
    for key, value in checkpoint["state_dict"].items():
        assert torch.allclose(value, final_full[key], atol=1e-6), key  # the same weights at step 8


def test_reference_model_is_not_saved_in_checkpoints(tmp_path):
    log_dir = _fit(tmp_path, "--trainer.max_steps", "1", "--model.loss.beta", "0.1", every_n=1)
    checkpoint = torch.load(log_dir / "checkpoints" / "step=1.ckpt", weights_only=True)
    assert any(k.startswith("policy.") for k in checkpoint["state_dict"])
    assert not any(k.startswith("ref_model.") for k in checkpoint["state_dict"])


def test_grpo_on_a_user_jsonl_file_with_chat_prompts(tmp_path):
    import json

    rows = [{"prompt": [{"role": "user", "content": f"{a}+{a}="}], "answer": str(2 * a)} for a in range(12)]
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    log_dir = _fit(
        tmp_path,
        "--trainer.max_steps",
        "2",
        "--data.train_data",
        str(data),
        "--data.val_data",
        str(data),
        "--trainer.val_check_interval",
        "2",
    )
    assert len(train_rows(log_dir)) == 2
    val = [r for r in read_metrics(log_dir) if r.get("val/rewards/correctness")]
    assert float(val[0]["val/rewards/correctness"]) > 0  # the chat template produced prompts the model can answer


def test_ckpt_path_last_resumes_from_the_newest_step(tmp_path):
    overlay = write_overlay(tmp_path / "o.yaml", every_n_train_steps=2, save_dir=tmp_path / "r", save_last="link")
    args = ("fit", "--config", GRPO, "--config", str(overlay), *FAST_GRPO, "--trainer.limit_val_batches", "0")
    run_cli(*args, "--trainer.max_steps", "4")
    checkpoints = tmp_path / "r" / "run" / "version_0" / "checkpoints"
    assert (checkpoints / "last.ckpt").resolve() == (checkpoints / "step=4.ckpt").resolve()
    run_cli(*args, "--trainer.max_steps", "6", "--ckpt_path", "last")
    # The same run continued: its metrics file keeps steps 1-4 and goes on.
    assert [r["step"] for r in train_rows(tmp_path / "r" / "run" / "version_0")] == [1, 2, 3, 4, 5, 6]
    assert saved_steps(tmp_path / "r" / "run" / "version_0") == [2, 4, 6]
