"""SFT through the real CLI: trains from a random init, logs train/ and val/, exports a loadable HF directory."""

import pytest

from lit_rl.modeling.models import load_causal_lm, load_tokenizer
from tests.conftest import CONFIGS, read_metrics, run_cli, saved_steps, train_rows, write_overlay

pytestmark = pytest.mark.slow


def test_sft_trains_checkpoints_and_exports(tmp_path):
    overlay = write_overlay(tmp_path / "o.yaml", every_n_train_steps=10, save_dir=tmp_path)
    export = tmp_path / "hf"
    run_cli(
        "fit",
        "--config",
        str(CONFIGS / "sft.yaml"),
        "--config",
        str(overlay),
        "--trainer.max_steps",
        "30",
        "--trainer.val_check_interval",
        "30",
        "--data.val_limit",
        "64",  # counts micro-batches
        "--trainer.accumulate_grad_batches",
        "2",
        "--data.batch_size",
        "16",
        "--trainer.callbacks+=lit_rl.callbacks.SaveHFPretrained",
        f"--trainer.callbacks.dirpath={export}",
    )
    log_dir = tmp_path / "run" / "version_0"
    assert saved_steps(log_dir) == [10, 20, 30]
    train = train_rows(log_dir)
    assert [r["step"] for r in train][-1] == 30
    assert train[-1]["train/loss"] < train[0]["train/loss"]
    assert [float(r["step"]) for r in read_metrics(log_dir) if r.get("val/loss")] == [15.0, 30.0]
    model, tokenizer = load_causal_lm(str(export)), load_tokenizer(str(export))
    assert model.config.model_type == "qwen2" and tokenizer.eos_token_id == model.config.eos_token_id
