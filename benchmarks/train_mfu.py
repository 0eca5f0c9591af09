"""Model-FLOP utilisation of lit-rl's training pass alone: its forward and backward, without generation or optimizer.

    python benchmarks/train_mfu.py --out benchmarks/results/train_mfu_cpu.json
    python benchmarks/train_mfu.py --quick                                     # the tiny model, 1 round, eager

Issue 34 sets a target for this pass: in fp32, at least 70% of the measured matmul peak. `perf/update_mfu` reports
the update's utilisation every step of a run, with an optimizer step, data loading and logging in its time; this
script times the pass alone: `completion_scores` (lit-rl's scoring forward: the completion tokens' log-probs) of a
batch shaped as GRPO's in `compare_trl.py --workloads fixed32`, 16 rows of 32 completion tokens after a prompt of 8,
then the backward of their sum. The model is that script's random 21M-parameter Qwen2 (hidden 512, 8 layers).
Every row has its own prompt, so every token the model computes is one the FLOP count counts
(`lit_rl/training/flops.py`).

- Settings: fp32; `bf16-mixed` (fp32 weights, bf16 autocast); `bf16-true` (bf16 weights); `fp32-compiled`, the
  policy compiled as `--model.policy.compile true` compiles it (its first pass, which compiles, is reported apart).
  Each with the model's default attention (sdpa); `-attn-eager`: the same with eager attention
  (`--model.policy.attn_implementation eager`: matmuls and a softmax instead of sdpa's CPU flash kernel).
- Timing: the median of every timed pass, after 2 warm-up passes per precision. Rounds alternate the precisions, so
  a slow spell of a shared machine hits each of them.
- MFU: the pass's model FLOPs over its median time, over the matmul peak of its compute dtype, measured with the
  probe `perf/mfu` uses (`measured_matmul_flops`) for 1 s instead of its 0.05 s: the best of more tries, so a
  higher peak and a stricter MFU than a run logs.
- The profile of one fp32 pass (torch.profiler, self CPU time) shows where the time goes: the matrix
  multiplications' share, fused attention's (its matmuls, softmax and masking), and the largest other operators.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from provenance import parse_report_args, publish  # noqa: E402
from support import build_random_model  # noqa: E402

from lit_rl.modeling.completions import completion_scores  # noqa: E402
from lit_rl.modeling.models import load_causal_lm  # noqa: E402
from lit_rl.training.flops import ModelShape, cpu_matmul_peak, row_tokens_and_keys  # noqa: E402

SIZES = {"20m": dict(hidden_size=512, num_hidden_layers=8, intermediate_size=1024), "tiny": dict()}
# fp32 on a policy compiled as `model.policy.compile` compiles it (`nn.Module.compile`): fused elementwise kernels.
# `-attn-eager`: eager attention (`model.policy.attn_implementation: eager`) instead of the model's sdpa.
SETTINGS = (
    "fp32",
    "fp32-attn-eager",
    "bf16-mixed",
    "bf16-true",
    "bf16-true-attn-eager",
    "fp32-compiled",
)
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def is_attention(op: str) -> bool:
    """Attention's fused kernels, forward and backward: its matmuls, softmax and masking in one operator."""
    return op.startswith("aten::_scaled_dot_product")


def batch(vocab: int, rows: int, prompt: int, completion: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(1, vocab, (rows, prompt), generator=generator)
    completion_ids = torch.randint(1, vocab, (rows, completion), generator=generator)
    return prompt_ids, torch.ones_like(prompt_ids), completion_ids, torch.ones(rows, completion)


def setting_model(path: Path, setting: str) -> torch.nn.Module:
    """The model a setting trains: bf16 weights for `bf16-true*`, eager attention for `*-attn-eager`, compiled
    for `*-compiled`; float32 weights and the model's default attention otherwise."""
    dtype = "bfloat16" if setting.startswith("bf16-true") else "float32"
    attention = "eager" if setting.endswith("-attn-eager") else None
    model = load_causal_lm(str(path), dtype=dtype, attn_implementation=attention).train()
    if setting.endswith("-compiled"):
        model.compile()
    return model


def training_pass(model: torch.nn.Module, data: tuple[torch.Tensor, ...], setting: str) -> None:
    mixed = setting.startswith("bf16-mixed")
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if mixed else contextlib.nullcontext()
    with autocast:
        scores = completion_scores(model, *data)
    scores.logprobs.float().sum().backward()
    model.zero_grad(set_to_none=True)


def measure(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = build_random_model(Path(tmp) / args.model, **SIZES[args.model])
        models = {setting: setting_model(path, setting) for setting in {"fp32", *args.settings}}
    data = batch(models["fp32"].config.vocab_size, args.rows, args.prompt_tokens, args.completion_tokens)
    shape = ModelShape.of(models["fp32"])
    tokens, keys = row_tokens_and_keys(data[0], data[1], data[3])
    flops = shape.forward_flops(tokens, keys) + shape.backward_flops(tokens, keys)
    peaks = {dtype: cpu_matmul_peak(dtype, seconds=1.0).flops for dtype in (torch.float32, torch.bfloat16)}
    times: dict[str, list[float]] = {setting: [] for setting in args.settings}
    first: dict[str, float] = {}
    for setting in args.settings:
        for _ in range(2):
            start = time.perf_counter()
            training_pass(models[setting], data, setting)
            first.setdefault(setting, time.perf_counter() - start)
    for _ in range(args.rounds):
        for setting in args.settings:
            for _ in range(args.passes):
                start = time.perf_counter()
                training_pass(models[setting], data, setting)
                times[setting].append(time.perf_counter() - start)
    rows = []
    for setting in args.settings:
        seconds = statistics.median(times[setting])
        peak = peaks[torch.float32 if setting.startswith("fp32") else torch.bfloat16]
        rows.append(
            {
                "setting": setting,
                "pass_s": seconds,
                "tflops": flops / seconds / 1e12,
                "peak_tflops": peak / 1e12,
                "mfu": flops / seconds / peak,
                "passes": len(times[setting]),
                "first_pass_s": first[setting],
            }
        )
    return {"model": args.model, "model_flops": flops, "passes": rows, "fp32_profile": profile(models["fp32"], data)}


def profile(model: torch.nn.Module, data: tuple[torch.Tensor, ...]) -> dict:
    """Self CPU time of one fp32 pass by operator: the matmuls' share, fused attention's, and the five largest
    other operators."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        training_pass(model, data, "fp32")
    events = [(e.key, e.self_cpu_time_total) for e in prof.key_averages()]
    total = sum(time for _, time in events)
    matmul = sum(time for key, time in events if key in MATMUL_OPS)
    attention = sum(time for key, time in events if is_attention(key))
    rest = [(key, time) for key, time in events if key not in MATMUL_OPS and not is_attention(key)]
    others = sorted(rest, key=lambda kv: -kv[1])[:5]
    return {
        "matmul_share": matmul / total,
        "attention_share": attention / total,
        "largest_others": [{"op": key, "share": time / total} for key, time in others],
    }


def markdown_table(results: dict) -> str:
    lines = [
        "| setting | s/pass (forward + backward) | first pass s | TFLOP/s | measured matmul peak, TFLOP/s | MFU |",
        "|---|---|---|---|---|---|",
    ]
    for r in results["passes"]:
        lines.append(
            f"| {r['setting']} | {r['pass_s']:.4f} | {r['first_pass_s']:.2f} | {r['tflops']:.3f} "
            f"| {r['peak_tflops']:.3f} | {100 * r['mfu']:.0f}% |"
        )
    return "\n".join(lines)


def claims(results: dict) -> list[str]:
    prof = results["fp32_profile"]
    others = ", ".join(f"{o['op']} {100 * o['share']:.0f}%" for o in prof["largest_others"][:3])
    return [
        *(
            f"{r['setting']}: the training pass reaches {100 * r['mfu']:.0f}% of the measured matmul peak "
            f"({'meets' if r['mfu'] >= 0.7 else 'misses'} the 70% target)"
            for r in results["passes"]
            if r["setting"].startswith("fp32")
        ),
        *(
            f"{r['setting']}: {base['pass_s'] / r['pass_s']:.2f}x the speed of {base['setting']}'s sdpa attention"
            for r in results["passes"]
            if r["setting"].endswith("-attn-eager")
            for base in results["passes"]
            if base["setting"] == r["setting"].removesuffix("-attn-eager")
        ),
        f"matrix multiplications take {100 * prof['matmul_share']:.0f}% of the eager fp32 pass's operator time, fused "
        f"attention {100 * prof['attention_share']:.0f}%; the largest others: {others}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="20m", choices=list(SIZES))
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=8)
    parser.add_argument("--completion-tokens", type=int, default=32)
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS))
    parser.add_argument("--passes", type=int, default=3, help="timed passes per setting per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="the tiny model, 1 round, nothing compiled")
    args = parse_report_args(parser, markdown_table, claims)
    if args.quick:
        args.model, args.rounds = "tiny", 1
        args.settings = [setting for setting in args.settings if setting != "fp32-compiled"]
    results = measure(args)
    publish(args, results, markdown_table, claims, workload=vars(args) | {"out": None, "markdown": None})


if __name__ == "__main__":
    main()
