"""LoRA through the real CLI (`--config configs/peft/lora.yaml`): the adapter-off reference gives the numbers of a
frozen copy, checkpoints hold the adapter and resume exactly, both exports load, and DDP, ZeRO-2 and ZeRO-3 agree."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from lit_rl.export import export_checkpoint
from tests.conftest import (
    CONFIGS,
    FAST_GRPO,
    assert_rows_match,
    fit_in_subprocess,
    run_cli,
    saved_steps,
    strategy_overlay,
    train_rows,
    without_engine_gap,
    write_overlay,
)

pytestmark = pytest.mark.slow

LORA = ("--config", str(CONFIGS / "peft" / "lora.yaml"), "--model.policy.lora.r", "8")
FROZEN_COPY = "tests.integration.frozen_reference"
FAST_DPO = ["--data.batch_size", "8", "--data.val_limit", "16", "--trainer.num_sanity_val_steps", "0"]


def _fit(tmp_path, name, config, *args, every_n_train_steps=None):
    overlay = write_overlay(
        tmp_path / f"{name}.yaml", every_n_train_steps=every_n_train_steps, save_dir=tmp_path / name
    )
    run_cli("fit", "--config", str(CONFIGS / config), "--config", str(overlay), *args)
    return tmp_path / name / "run" / "version_0"


def _grpo(tmp_path, name, *args, max_steps=3, **kwargs):
    grpo = (
        *FAST_GRPO,
        "--model.loss.beta",
        "0.04",
        "--model.optim.learning_rate",
        "1e-3",
        "--trainer.max_steps",
        str(max_steps),
    )
    return _fit(tmp_path, name, "grpo.yaml", *grpo, *args, **kwargs)


def test_grpo_reference_from_the_disabled_adapter_equals_a_frozen_copy(tmp_path):
    shared = _grpo(tmp_path, "adapter_off", *LORA)
    copy = _grpo(tmp_path, "frozen_copy", *LORA, "--model.class_path", f"{FROZEN_COPY}.GRPOWithFrozenCopy")
    rows = train_rows(shared)
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert rows[-1]["train/kl"] > 1e-4  # the adapter moved the policy away from its reference
    assert_rows_match(rows, train_rows(copy), rel=1e-5, abs=1e-6)


def test_dpo_reference_from_the_disabled_adapter_equals_a_frozen_copy(tmp_path):
    dpo = (*FAST_DPO, "--trainer.max_steps", "3", "--model.optim.learning_rate", "1e-3")
    shared = _fit(tmp_path, "adapter_off", "dpo.yaml", *dpo, *LORA)
    copy = _fit(
        tmp_path, "frozen_copy", "dpo.yaml", *dpo, *LORA, "--model.class_path", f"{FROZEN_COPY}.DPOWithFrozenCopy"
    )
    rows = train_rows(shared)
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert abs(rows[-1]["train/rewards/margins"]) > 1e-4  # the policy left its reference
    assert_rows_match(rows, train_rows(copy), rel=1e-5, abs=1e-6)


@pytest.fixture(scope="module")
def full_weights_run(tmp_path_factory):
    """GRPO without LoRA, 2 steps, a checkpoint at step 2: what a LoRA checkpoint is compared with, and what has no
    adapter to export (one run for both tests). Its environment variables are undone, as every test's are."""
    from tests.conftest import environment_restored

    with environment_restored():
        return _grpo(tmp_path_factory.mktemp("full_weights"), "full_weights", max_steps=2, every_n_train_steps=2)


def test_checkpoints_hold_the_adapter_resume_exactly_and_export_both_ways(tmp_path, full_weights_run):
    save_hf = "--trainer.callbacks+=lit_rl.callbacks.SaveHFPretrained"
    full = _grpo(tmp_path, "full", *LORA, save_hf, max_steps=4, every_n_train_steps=2)
    assert saved_steps(full) == [2, 4]
    half = _grpo(tmp_path, "half", *LORA, max_steps=2, every_n_train_steps=2)
    resumed = _grpo(
        tmp_path,
        "half",
        *LORA,
        "--ckpt_path",
        str(half / "checkpoints" / "step=2.ckpt"),
        max_steps=4,
        every_n_train_steps=2,
    )
    rows = [row for row in train_rows(resumed) if row["step"] > 2]
    assert [row["step"] for row in rows] == [3, 4]
    assert_rows_match(rows, train_rows(full), rel=1e-6, abs=1e-7)

    # The checkpoint holds the adapter and its optimizer state, not the frozen weights.
    lora_size = (full / "checkpoints" / "step=2.ckpt").stat().st_size
    full_size = (full_weights_run / "checkpoints" / "step=2.ckpt").stat().st_size
    assert lora_size < 0.2 * full_size, (lora_size, full_size)
    state = torch.load(full / "checkpoints" / "step=2.ckpt", weights_only=False)["state_dict"]
    assert state and all(".lora_" in key for key in state)

    # The merged export is the model the run ended with; the adapter export on its base gives the same logits.
    merged = export_checkpoint(full / "checkpoints" / "step=4.ckpt", tmp_path / "merged")
    adapter = export_checkpoint(full / "checkpoints" / "step=4.ckpt", tmp_path / "adapter", adapter_only=True)
    exported = load_file(merged / "model.safetensors")
    at_end = load_file(full / "hf" / "model.safetensors")
    assert exported.keys() == at_end.keys()
    assert all(torch.equal(exported[key], at_end[key]) for key in exported)
    assert (
        load_file(adapter / "adapter_model.safetensors").keys()
        == load_file(full / "hf" / "adapter" / "adapter_model.safetensors").keys()
    )

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lit_rl.modeling.models import load_causal_lm

    ids = torch.randint(0, 256, (2, 10))
    with torch.no_grad():
        merged_logits = AutoModelForCausalLM.from_pretrained(merged)(ids).logits
        with_adapter = PeftModel.from_pretrained(load_causal_lm("lit-rl/tiny-qwen2-addition-sft"), adapter)
        adapter_logits = with_adapter(ids).logits
        base_logits = load_causal_lm("lit-rl/tiny-qwen2-addition-sft")(ids).logits
    assert (merged_logits - adapter_logits).abs().max() < 1e-4
    assert (merged_logits - base_logits).abs().max() > 1e-3  # the adapter is in the merged weights


def test_exporting_an_adapter_from_a_full_checkpoint_is_one_line_error(tmp_path, full_weights_run):
    import subprocess

    from tests.conftest import cli_env

    checkpoint = full_weights_run / "checkpoints" / "step=2.ckpt"
    command = ["lit-rl", "export", str(checkpoint), "out", "--adapter"]  # as the docs print
    result = subprocess.run(command, cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .endswith("was not trained with model.policy.lora: it has no adapter to export")
    )
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


def _distributed(tmp_path, name, strategy):
    return fit_in_subprocess(
        tmp_path,
        name,
        "grpo.yaml",
        *strategy_overlay(strategy),
        *LORA,
        *FAST_GRPO,
        "--model.schedule.micro_batch_size",
        "4",
        "--trainer.accumulate_grad_batches",
        "2",
        "--model.loss.beta",
        "0.04",
        "--model.optim.learning_rate",
        "1e-3",
        "--trainer.max_steps",
        "4",
    )


@pytest.fixture(scope="module")
def ddp_lora(tmp_path_factory):
    return _distributed(tmp_path_factory.mktemp("ddp_lora"), "ddp", "ddp")


def test_lora_on_two_ddp_processes_has_exact_cadence(ddp_lora):
    assert saved_steps(ddp_lora) == [2, 4]
    rows = train_rows(ddp_lora)
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert rows[0]["train/kl"] == pytest.approx(0.0, abs=1e-7)  # B = 0: the adapted policy starts at the reference
    assert rows[-1]["train/kl"] > 1e-4


@pytest.mark.parametrize("stage", ["deepspeed_zero2", "deepspeed_zero3"])
def test_lora_under_zero_matches_ddp_step_for_step(tmp_path, ddp_lora, stage):
    log_dir = _distributed(tmp_path, stage, stage)
    assert saved_steps(log_dir) == [2, 4]
    rows, reference = without_engine_gap(train_rows(log_dir)), without_engine_gap(train_rows(ddp_lora))
    assert_rows_match(rows, reference, rel=1e-5, abs=1e-6)
