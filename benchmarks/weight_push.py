"""Where a colocated weight push's time goes: vLLM's `reload_weights` on the policy's weights, timed and profiled.

    python benchmarks/weight_push.py                          # the tiny model, 20 timed and 10 profiled pushes
    python benchmarks/weight_push.py --json out.json
    python benchmarks/weight_push.py --markdown benchmarks/results/weight_push_cpu.json   # the README's table

Starts lit-rl's colocated engine (in-process vLLM) for the model and pushes the policy's weights through
`VLLMColocateEngine.update_weights`, as training does after every optimizer step. Reports the mean seconds per
push, then profiles more pushes (cProfile) and splits their time into the parts below. Needs vLLM (the CPU build
runs here; on a GPU the same script measures the GPU path).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from provenance import add_allow_dirty, check_output, write_report  # noqa: E402

# Function names whose cumulative time makes each part (vLLM 0.32).
PARTS = {
    "re-pack for the CPU GEMM kernels": "dispatch_cpu_unquantized_gemm",
    "vLLM load_weights (re-pack included)": "load_weights",
    "reload_weights in all": "reload_weights",
}


def cumulative_seconds(stats: pstats.Stats, function_name: str) -> float:
    """The largest cumulative time of a function of this name (the outermost of nested same-named calls)."""
    times = [value[3] for (_, _, name), value in stats.stats.items() if name == function_name]
    return max(times, default=0.0)


def markdown_table(results: list[dict]) -> str:
    """The README's table of a results file (a test checks the README carries exactly this)."""
    lines = [
        "| model | tensors | seconds per push (mean) | " + " | ".join(PARTS) + " |",
        "|---|---|---|" + "---|" * len(PARTS),
    ]
    for r in results:
        shares = " | ".join(f"{100 * r['profiled_shares'][part]:.0f}%" for part in PARTS)
        lines.append(f"| {r['model']} | {r['tensors']} | {r['push_s_mean']:.4f} | {shares} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="lit-rl/tiny-qwen2-addition-sft")
    parser.add_argument("--pushes", type=int, default=20)
    parser.add_argument("--profiled-pushes", type=int, default=10)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None, help="print the markdown table of a results JSON")
    add_allow_dirty(parser)
    args = parser.parse_args()
    if args.markdown:
        print(markdown_table(json.loads(args.markdown.read_text())["results"]))
        return
    check_output(args.json, args.allow_dirty)

    import torch
    from support import policy_weights

    from lit_rl.modeling.models import load_causal_lm, resolve_model_path
    from lit_rl.rollout import VLLMColocate
    from lit_rl.rollout.engines.placement import EnginePlacement
    from lit_rl.rollout.engines.vllm import VLLMColocateEngine

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    path = str(resolve_model_path(args.model))
    model = load_causal_lm(path)
    placement = EnginePlacement(rank=0, local_rank=0, world_size=1, local_world_size=1)
    engine = VLLMColocateEngine.start(VLLMColocate(), path, model.dtype, torch.device("cpu"), [0], 0, placement)
    try:
        engine.update_weights(policy_weights(model))  # the first push: one-off set-up
        seconds = []
        for _ in range(args.pushes):
            start = time.perf_counter()
            engine.update_weights(policy_weights(model))
            seconds.append(time.perf_counter() - start)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.profiled_pushes):
            engine.update_weights(policy_weights(model))
        profiler.disable()
    finally:
        engine.close()
    stats = pstats.Stats(profiler)
    profiled = cumulative_seconds(stats, "update_weights")
    shares = {part: cumulative_seconds(stats, name) / profiled for part, name in PARTS.items()}
    result = {
        "model": args.model,
        "tensors": len(policy_weights(model)),
        "parameters": sum(p.numel() for p in model.parameters()),
        "push_s_mean": statistics.mean(seconds),
        "push_s_median": statistics.median(seconds),
        "profiled_shares": shares,
    }
    print(f"{args.model}: {result['tensors']} tensors, {result['parameters']:,} parameters")
    print(f"push: mean {result['push_s_mean'] * 1e3:.1f} ms, median {result['push_s_median'] * 1e3:.1f} ms")
    for part, share in shares.items():
        print(f"  {part}: {100 * share:.0f}% of the profiled push time")
    if args.json:
        write_report(args.json, [result], allow_dirty=args.allow_dirty)


if __name__ == "__main__":  # vLLM may start worker processes: keep the guard
    main()
