"""bf16 through the real CLI: every algorithm trains under `bf16-mixed` (fp32 weights, bf16 autocast) and
`bf16-true` (bf16 weights), with gradient clipping on; a vLLM engine then samples in bf16, and GRPO's truncated
importance-sampling correction switches itself on."""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import CONFIGS, FAST_GRPO, cli_env, fit_in_subprocess, run_cli, train_rows, write_overlay

pytestmark = pytest.mark.slow

FAST_DPO = ["--data.batch_size", "8", "--data.val_limit", "16", "--trainer.num_sanity_val_steps", "0"]
ALGORITHMS = {
    "grpo": FAST_GRPO,
    "rloo": FAST_GRPO,
    "online_dpo": [*FAST_GRPO, "--model.sampling.num_generations", "2"],
    "dpo": FAST_DPO,
    "sft": ["--data.batch_size", "8", "--data.val_limit", "8", "--trainer.log_every_n_steps", "1"],
}
PROBE = "tests.integration.probes.RecordPrecision"


def _fit_bf16(tmp_path, algorithm: str, precision: str, *args: str):
    overlay = write_overlay(tmp_path / "o.yaml", save_dir=tmp_path)
    run_cli(
        "fit",
        "--config",
        str(CONFIGS / f"{algorithm}.yaml"),
        "--config",
        str(overlay),
        *ALGORITHMS[algorithm],
        "--trainer.max_steps",
        "2",
        "--trainer.precision",
        precision,
        "--trainer.gradient_clip_val",
        "1.0",
        "--trainer.callbacks+",
        PROBE,
        "--trainer.callbacks.directory",
        str(tmp_path / "probe"),
        *args,
    )
    rows = train_rows(tmp_path / "run" / "version_0")
    probe = json.loads((tmp_path / "probe" / "precision_rank0.json").read_text())
    return rows, probe


@pytest.mark.parametrize("precision, weights", [("bf16-mixed", "float32"), ("bf16-true", "bfloat16")])
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_every_algorithm_trains_in_bf16(tmp_path, algorithm, precision, weights):
    rows, probe = _fit_bf16(tmp_path, algorithm, precision)
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        # Online DPO: a step whose pairs all tied has no pair to average (its pair metrics are 0/0).
        all_tied = row.get("train/frac_tied_pairs") == 1.0
        pair_metric = lambda key: key.startswith(("train/rewards/", "train/logps/"))  # noqa: E731
        assert all(math.isfinite(v) for k, v in row.items() if not (all_tied and pair_metric(k))), row
        assert math.isfinite(row["train/loss"])
    assert probe["parameters"] == weights and probe["logits"] == "bfloat16"
    if algorithm == "grpo":  # HF generate samples from the policy itself: nothing to correct
        assert probe["rollout_correction"] == "none"


def test_colocated_vllm_samples_in_bf16_and_the_is_correction_turns_on(tmp_path):
    probes = []
    for probe in ("RecordPrecision", "RecordEnginePlacement"):
        probes += ["--trainer.callbacks+", f"tests.integration.probes.{probe}"]
        probes += ["--trainer.callbacks.directory", str(tmp_path / "probe")]
    log_dir = fit_in_subprocess(  # vLLM starts in a process of its own
        tmp_path,
        "vllm_bf16",
        "grpo.yaml",
        *FAST_GRPO,
        "--config",
        str(CONFIGS / "rollout" / "vllm_colocate.yaml"),
        "--trainer.max_steps",
        "2",
        "--trainer.precision",
        "bf16-mixed",
        *probes,
        every_n_train_steps=None,
        env={**cli_env(), "VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    engine = json.loads((tmp_path / "probe" / "engine_rank0.json").read_text())
    precision = json.loads((tmp_path / "probe" / "precision_rank0.json").read_text())
    assert engine["dtype"] == "bfloat16"
    assert precision["rollout_correction"] == "token_truncate"  # `auto`: the engine computes below float32
    rows = train_rows(log_dir)
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:  # the engine-trainer mismatch is logged, and in bf16 it is visibly not zero
        assert 0 < row["train/rollout_kl"] < 0.05
        ratio = [row[f"train/rollout_is_ratio/{stat}"] for stat in ("min", "mean", "max")]
        assert ratio == sorted(ratio) and ratio[2] > 1.0
