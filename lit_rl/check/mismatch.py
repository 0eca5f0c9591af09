"""`lit-rl check --mismatch`: where a rollout/trainer mismatch comes from.

A rollout algorithm logs, every step, how far the engine's log-probs of the tokens it sampled are from the
trainer's (`train/rollout_kl`: the k3 estimate of KL(engine || trainer) per sampled token; `train/rollout_is_ratio/*`:
r = exp(trainer - engine log-prob); `train/rollout_logprob_diff/max`). When those are large, the question is
which factor causes it. This runs one optimizer step of the user's config as configured and once per factor
changed, and reports the numbers of each, naming the factor whose change moves the KL most:

    engine      : the configured engine against HF `generate` on the same weights
    dtype       : the policy's dtype (bfloat16 against float32, whichever the config does not use)
    packing     : the trainer's forward padding-free against padded
    lora        : HF `generate` from the weights with the adapter merged in (as vLLM computes) against the
                  adapter kept apart (as the trainer computes); only with `model.policy.lora`. Its runs take 2
                  steps: at step 1 the adapter is still zero.

With an engine that holds its own weights (vLLM), the `engine` row samples with HF through the adapter and the
`lora` row with HF from merged weights: the two rows together split the engine's kernels from the merge.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

from lit_rl.check.layouts import CannotRunHere, Layout, get
from lit_rl.rollout.engine_config import HFGenerate, class_path

MISMATCH_METRICS = (
    "train/rollout_kl",
    "train/rollout_is_ratio/min",
    "train/rollout_is_ratio/max",
    "train/rollout_logprob_diff/max",
)


@dataclass
class FactorResult:
    factor: str
    change: str
    values: dict[str, float]
    skipped: str = ""


def factor_layouts(config: dict) -> list[tuple[str, Optional[Layout], str]]:
    """(factor, layout or None, why it is skipped) for each factor this config can vary."""
    init = "model.init_args"
    if get(config, f"{init}.rollout") is None:
        raise CannotRunHere("the algorithm samples no rollouts (DPO and SFT train on fixed data)")
    out: list[tuple[str, Optional[Layout], str]] = []
    engine = get(config, f"{init}.rollout.engine")
    if engine is None:
        out.append(("engine", None, "the config samples with HF generate already"))
    else:
        name = str(engine.get("class_path", engine) if isinstance(engine, dict) else engine).rsplit(".", 1)[-1]
        layout = Layout("engine_hf", {f"{init}.rollout.engine": None}, description=f"HF generate instead of {name}")
        out.append(("engine", layout, ""))
    dtype = str(get(config, f"{init}.policy.dtype") or "float32")
    other = "float32" if "bfloat16" in dtype else "bfloat16"
    out.append(("dtype", Layout(f"dtype_{other}", {f"{init}.policy.dtype": other}), ""))
    padding_free = bool(get(config, f"{init}.policy.padding_free"))
    out.append(("packing", Layout("packing", {f"{init}.policy.padding_free": not padding_free}), ""))
    if get(config, f"{init}.policy.lora") is None:
        out.append(("lora", None, "the config trains no LoRA adapter"))
    else:
        merged = {"class_path": class_path(HFGenerate), "init_args": {"lora_weights": "merged"}}
        layout = Layout("lora_merged", {f"{init}.rollout.engine": merged}, description="HF generate, adapter merged")
        out.append(("lora", layout, ""))
    return out


def steps_needed(config: dict) -> int:
    """Optimizer steps each run takes; its last step is reported. A LoRA adapter starts at B = 0 (merged or not,
    the same weights), so with one the runs take 2 steps and the second samples from a trained adapter."""
    return 1 if get(config, "model.init_args.policy.lora") is None else 2


# A `train/rollout_kl` at or below this is rounding: float32 log-probs of the same weights, computed by two code
# paths, differ by ~1e-7 a token, a KL of ~1e-14.
KL_ROUNDING = 1e-9


def moved_most(baseline: dict[str, float], results: list[FactorResult]) -> Optional[str]:
    """The factor whose change moved `train/rollout_kl` furthest from the baseline's (in log scale: KL spans
    orders of magnitude); None when none moved it beyond `KL_ROUNDING` (every value at or below it is rounding:
    one that fell from 7e-14 to 1e-14 was named the factor)."""
    key = "train/rollout_kl"
    if key not in baseline:
        return None

    def distance(result: FactorResult) -> float:
        if key not in result.values:
            return -1.0
        return abs(math.log10(max(result.values[key], KL_ROUNDING)) - math.log10(max(baseline[key], KL_ROUNDING)))

    ran = [r for r in results if not r.skipped and r.values]
    most = max(ran, key=distance) if ran else None
    return most.factor if most is not None and distance(most) > 0 else None


def run_mismatch(
    config: dict, run_one: Callable[[Layout], dict[str, float]]
) -> tuple[dict[str, float], list[FactorResult]]:
    """The mismatch metrics of one step as configured, and of one step per factor changed."""
    factors = factor_layouts(config)  # before any run: a config without rollouts is refused at once
    baseline = run_one(Layout("as_configured"))
    results = []
    for factor, layout, why in factors:
        if layout is None:
            results.append(FactorResult(factor, "", {}, skipped=why))
            continue
        results.append(FactorResult(factor, layout.describe(), run_one(layout)))
    return baseline, results
