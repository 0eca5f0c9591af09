"""DeepSpeed ZeRO-2 and ZeRO-3 on CPU processes (gloo), through the real CLI and the shipped overlays, with a
reference model (beta > 0) and gradient accumulation: the same per-step numbers as DDP, exact checkpoint cadence,
exact resume from sharded checkpoints, rollouts from a ZeRO-3 policy into vLLM, checkpoint conversion to a Hugging
Face directory, and an 8-process run."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import (
    CONFIGS,
    FAST_GRPO,
    assert_rows_match,
    cli_env,
    fit_in_subprocess,
    saved_steps,
    strategy_overlay,
    train_rows,
    without_engine_gap,
)

pytestmark = pytest.mark.slow

STRATEGY = CONFIGS / "strategy"


def _rows(log_dir):
    return without_engine_gap(train_rows(log_dir))


def _fit(tmp_path, name, strategy, *args, max_steps=4):
    return fit_in_subprocess(
        tmp_path,
        name,
        "grpo.yaml",
        *strategy_overlay(strategy),
        *FAST_GRPO,
        "--model.micro_batch_size",
        "4",
        "--trainer.accumulate_grad_batches",
        "2",
        "--model.beta",
        "0.04",  # a frozen reference model too: partitioned under ZeRO-3, never given to the optimizer
        "--trainer.max_steps",
        str(max_steps),
        *args,
    )


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory):
    return _fit(tmp_path_factory.mktemp("ddp"), "ddp", "ddp")


@pytest.mark.parametrize("stage", ["deepspeed_zero2", "deepspeed_zero3"])
def test_zero_matches_ddp_step_for_step_with_exact_cadence(tmp_path, ddp_reference, stage):
    log_dir = _fit(tmp_path, stage, stage)
    assert saved_steps(log_dir) == [2, 4]  # every_n_train_steps=2 under accumulation 2: micro-batches 4 and 8
    assert (log_dir / "checkpoints" / "step=2.ckpt").is_dir()  # DeepSpeed writes sharded checkpoint directories
    rows = _rows(log_dir)
    assert [row["step"] for row in rows] == [1, 2, 3, 4]  # one row per optimizer step, not per micro-batch
    assert_rows_match(rows, _rows(ddp_reference), rel=1e-5, abs=1e-6)


def test_zero3_resumes_from_a_sharded_checkpoint_exactly(tmp_path, ddp_reference):
    half = _fit(tmp_path, "half", "deepspeed_zero3", max_steps=2)
    resumed = _fit(tmp_path, "resumed", "deepspeed_zero3", "--ckpt_path", str(half / "checkpoints" / "step=2.ckpt"))
    assert saved_steps(resumed) == [4]  # its own directory: the next multiple of 2 after the resumed step
    rows = [row for row in _rows(resumed) if row["step"] > 2]
    assert [row["step"] for row in rows] == [3, 4]
    assert_rows_match(rows, _rows(ddp_reference), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("devices", [1, 2])
def test_zero3_policy_pushes_gathered_weights_into_vllm(tmp_path, devices):
    # In one process DeepSpeed's prefetch leaves parameters in flight when a training step starts; a push that
    # gathered them then failed with "Cannot partition a param in flight" (`settle_zero3_parameters`).
    colocate = ("--config", str(CONFIGS / "rollout" / "vllm_colocate.yaml"))
    log_dir = _fit(tmp_path, "vllm", "deepspeed_zero3", *colocate, "--trainer.devices", str(devices), max_steps=3)
    rows = train_rows(log_dir)
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        assert row["train/rollout_logprob_diff/max"] < 1e-4, row  # vLLM sampled from the whole, current policy


def test_zero3_checkpoint_converts_to_a_loadable_hf_directory(tmp_path):
    log_dir = _fit(tmp_path, "export", "deepspeed_zero3", "--trainer.callbacks+", "lit_rl.callbacks.SaveHFPretrained")
    out = tmp_path / "hf-step4"
    subprocess.run(
        [sys.executable, "-m", "lit_rl.export", str(log_dir / "checkpoints" / "step=4.ckpt"), str(out)],
        env=cli_env(),
        check=True,
        capture_output=True,
        timeout=300,
    )
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    assert sum(p.numel() for p in model.parameters()) > 1_000_000
    # The converted step-4 checkpoint holds exactly the weights the run exported at its end (step 4).
    converted, exported = load_file(out / "model.safetensors"), load_file(log_dir / "hf" / "model.safetensors")
    assert sorted(converted) == sorted(exported)
    for key, value in exported.items():
        assert torch.equal(converted[key], value), key


@pytest.mark.eight_processes
def test_eight_processes_ddp_and_zero3_log_the_global_values_with_exact_cadence(tmp_path):
    # 8 ranks x 4 completions x accumulation 2 = 64 completions per step; one process with accumulation 16 takes
    # the same global batch, so its values are the global values the 8-process runs must log.
    eight = ("--trainer.devices", "8")
    single = _rows(
        _fit(
            tmp_path, "single", "ddp", "--trainer.devices", "1", "--trainer.accumulate_grad_batches", "16", max_steps=2
        )
    )
    ddp = _rows(_fit(tmp_path, "ddp8", "ddp", *eight, max_steps=2))
    zero3_dir = _fit(tmp_path, "zero3_8", "deepspeed_zero3", *eight, max_steps=2)
    assert saved_steps(zero3_dir) == [2]
    assert [row["step"] for row in ddp] == [row["step"] for row in single] == [1, 2]
    assert_rows_match(ddp, single, rel=1e-5, abs=1e-6)
    assert_rows_match(_rows(zero3_dir), single, rel=1e-5, abs=1e-6)
