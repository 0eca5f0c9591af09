"""The GPU acceptance tests (`pytest -m gpu`): what only a CUDA device can show, on the tiny model, through the real
CLI. Skipped where no GPU is visible, so CI (CPU) collects and skips them. The numbers at scale come from
`benchmarks/gpu_suite.py`.

- the colocated engine is built through vLLM's external launcher on the rank's own GPU (`cuda:LOCAL_RANK`), in
  bf16 under `bf16-mixed`, with GRPO's importance-sampling correction switched on by `auto`;
- sleep mode wakes and sleeps the engine on every step (`perf/engine_wake_s`, `perf/engine_sleep_s`) and the
  engine still samples from the pushed weights;
- under ZeRO-3 (bucketed, every parameter partitioned) and FSDP the pushed weights are the policy's;
- without vLLM (HF `generate`), GRPO trains on the GPU in `bf16-mixed` alone, under ZeRO-2/3 and under FSDP, and
  the policy computes in bf16 on the GPU;
- compiled decoding (`configs/rollout/hf_compiled.yaml`: a static cache and the one-token step as CUDA graphs)
  samples the eager loop's tokens with their log-probs in float32, and GRPO trains with it in `bf16-mixed`.

The vLLM tests are skipped, with the reason, where vLLM is not installed (a GPU machine without a registry).
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from lit_rl.training.flops import gpu_peaks
from tests.conftest import CONFIGS, FAST_GRPO, fit_in_subprocess, read_metrics, strategy_overlay, train_rows
from tests.integration.probes import probe_flags

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GPU = ("--trainer.accelerator", "gpu", "--trainer.devices", "1")
COLOCATE = ("--config", str(CONFIGS / "rollout" / "vllm_colocate.yaml"))
TINY = "lit-rl/tiny-qwen2-addition-sft"
BF16_GAP = 0.05  # mean k3 KL between a bf16 engine's and the bf16-mixed trainer's log-probs, per token


def _probes(directory, probes=("RecordPrecision", "RecordEnginePlacement")) -> list[str]:
    return [flag for probe in probes for flag in probe_flags(probe, directory)]


def _fit(tmp_path, name, *args, steps=4, engine=COLOCATE):
    colocated = engine == COLOCATE
    vllm = ("--model.rollout.engine.gpu_memory_utilization", "0.2") if colocated else ()
    probes = ("RecordPrecision", "RecordEnginePlacement") if colocated else ("RecordPrecision",)
    return fit_in_subprocess(
        tmp_path,
        name,
        "grpo.yaml",
        *FAST_GRPO,
        *GPU,
        *engine,
        "--trainer.precision",
        "bf16-mixed",
        "--trainer.max_steps",
        str(steps),
        *vllm,
        *args,
        *_probes(tmp_path / f"{name}_probe", probes),
    )


needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")


@needs_vllm
def test_colocated_engine_on_the_ranks_gpu_in_bf16_with_sleep_mode(tmp_path):
    log_dir = _fit(tmp_path, "sleep", "--model.rollout.engine.enable_sleep_mode", "true")
    engine = json.loads((tmp_path / "sleep_probe" / "engine_rank0.json").read_text())
    precision = json.loads((tmp_path / "sleep_probe" / "precision_rank0.json").read_text())
    assert engine["executor"] == "ExecutorWithExternalLauncher"
    assert engine["device"] == "cuda:0" and engine["dtype"] == "bfloat16"
    assert engine["tp_ranks"] == [0] and engine["world_ranks"] == [0]
    assert precision["rollout_correction"] == "token_truncate"
    rows = train_rows(log_dir)
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert all(row["train/rollout_kl"] < BF16_GAP for row in rows), rows  # it samples from the pushed weights
    perf = [row for row in read_metrics(log_dir) if row.get("perf/step_s")]
    # Every step after the first wakes the weights and the KV cache and sleeps after generating.
    assert all(float(row["perf/engine_wake_s"]) > 0 for row in perf[1:])
    assert all(float(row["perf/engine_sleep_s"]) > 0 for row in perf)


@needs_vllm
@pytest.mark.parametrize("strategy", ["deepspeed_zero3", "fsdp"])
def test_sharded_policies_push_their_weights_into_the_colocated_engine(tmp_path, strategy):
    # GPU after the overlay, which names its own device count.
    log_dir = _fit(
        tmp_path, strategy, *strategy_overlay(strategy), *GPU, "--model.rollout.engine.push_bucket_mib", "0.25"
    )
    rows = train_rows(log_dir)
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert all(row["train/rollout_kl"] < BF16_GAP for row in rows), rows


@pytest.mark.parametrize("strategy", ["single", "deepspeed_zero2", "deepspeed_zero3", "fsdp"])
def test_grpo_trains_on_the_gpu_in_bf16_with_hf_generate(tmp_path, strategy):
    overlay = (*strategy_overlay(strategy), *GPU) if strategy != "single" else ()
    log_dir = _fit(tmp_path, strategy, *overlay, engine=())
    precision = json.loads((tmp_path / f"{strategy}_probe" / "precision_rank0.json").read_text())
    assert precision["logits"] == "bfloat16", precision  # the forward computes in bf16 on the GPU
    rows = train_rows(log_dir)
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert all(torch.isfinite(torch.tensor(row["train/loss"])) for row in rows), rows
    # Utilisation over the data sheet's bf16 peak of a known GPU (one not in `GPU_PEAKS` logs no `perf/mfu`).
    if gpu_peaks(torch.cuda.get_device_name()) is not None:
        mfu = [float(row["perf/mfu"]) for row in read_metrics(log_dir) if row.get("perf/mfu")]
        assert len(mfu) == 4 and all(0 < value < 1 for value in mfu), mfu


def test_compiled_decoding_on_the_gpu_samples_the_eager_tokens_with_their_logprobs():
    """The CUDA-graph step (`mode="reduce-overhead"`) against the eager loop, float32, on the GPU: the same tokens,
    log-probs within the 1e-5 that the CPU tests hold (`tests/test_static_decode.py`), shared prompts included."""
    from lit_rl.modeling.models import load_causal_lm, load_tokenizer
    from lit_rl.rollout import HFGenerateEngine, SamplingParams

    tokenizer, model = load_tokenizer(TINY), load_causal_lm(TINY).to("cuda")
    eager = HFGenerateEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    compiled = HFGenerateEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, compiled=True)
    enc = tokenizer(["1+2=", "45+67=", "9+99=", "123+4567="], padding=True, return_tensors="pt")
    ids, mask = (enc[key].repeat_interleave(4, 0).to("cuda") for key in ("input_ids", "attention_mask"))
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    seeds = list(range(3, 3 + len(ids)))
    a = eager.generate(ids, mask, params, seeds)
    for _ in range(2):  # the second call replays the recorded graphs
        b = compiled.generate(ids, mask, params, seeds)
        assert torch.equal(a.completion_ids, b.completion_ids)
        gap = (a.logprobs - b.logprobs).abs().max().item()
        assert gap <= 1e-5, f"max |log-prob gap| {gap:.2e}"


def test_grpo_trains_on_the_gpu_in_bf16_with_compiled_decoding(tmp_path):
    overlay = ("--config", str(CONFIGS / "rollout" / "hf_compiled.yaml"))
    log_dir = _fit(tmp_path, "compiled", engine=overlay)
    rows = train_rows(log_dir)
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert all(torch.isfinite(torch.tensor(row["train/loss"])) for row in rows), rows
