"""One weight matmul at decoding's row count, as `F.linear` computes it and on a weight packed into the CPU library's
own layout (`lit_rl/rollout/engines/packed_linear.py`), with the cost of packing: what decides which weights compiled
decoding packs on CPU, and why bfloat16 ones are not packed.

    python benchmarks/packed_linear.py --out benchmarks/results/packed_linear_cpu.json
    python benchmarks/packed_linear.py --markdown benchmarks/results/packed_linear_cpu.json
    python benchmarks/packed_linear.py --quick          # two shapes, 8 MiB of weights, one round

For float32 and bfloat16 and each weight shape (the 21M-parameter model's [512, 512], [1024, 512] and [512, 1024],
smaller and larger ones): the median time of `F.linear` on a [rows, 1, in] input; of `torch.ops.lit_rl.packed_linear`
on a packed float32 weight (MKL's pack, what the compiled step runs, the op's own overhead included); of oneDNN's
bfloat16 product on a packed weight (`mkldnn._linear_pointwise`, not used by lit-rl); and of packing the weight once
(MKL's `_mkl_reorder_linear_weight`, oneDNN's `_reorder_linear_weight`). As in decoding, where each token reads
every weight of the model once, each call reads its weight from memory, not from a cache: a round cycles through
enough distinct weights of the shape (`--cycle-mib` in all). `break-even tokens`: how many one-token steps a pack
must serve to repay its packing; training changes the weights before every generation, so a pack serves one
generation (32 tokens in the TRL comparison's workload). Rounds alternate the calls; 2 CPU threads.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from provenance import parse_report_args, publish  # noqa: E402

from lit_rl.numerics import settle_cpu_math_kernels  # noqa: E402

settle_cpu_math_kernels()  # as every lit-rl process does, before any threaded float math (lit_rl/numerics.py)

SHAPES = [(128, 128), (512, 128), (512, 512), (1024, 512), (512, 1024), (2048, 512), (4864, 896)]


def timed_us(call) -> float:
    began = time.perf_counter()
    call()
    return (time.perf_counter() - began) * 1e6


def measured_dtypes() -> list[torch.dtype]:
    """float32, and bfloat16 where the CPU has bf16 instructions: oneDNN packs bf16 weights only there (on an AVX2
    CPU its reorder refuses them: "bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl and
    avx512dq")."""
    from lit_rl.training.flops import native_reduced_precision

    return [torch.float32] + ([torch.bfloat16] if native_reduced_precision(torch.bfloat16) else [])


def measure(rows: int, rounds: int, cycle_mib: int, shapes: list[tuple[int, int]] = SHAPES) -> list[dict]:
    from lit_rl.rollout.engines.packed_linear import packed_weights

    results = []
    for dtype in measured_dtypes():
        for out_features, in_features in shapes:
            torch.manual_seed(0)
            size = out_features * in_features * torch.tensor([], dtype=dtype).element_size()
            copies = max(1, (cycle_mib << 20) // size)
            weights = [
                torch.nn.Parameter(torch.randn(out_features, in_features, dtype=dtype), requires_grad=False)
                for _ in range(copies)
            ]
            x = torch.randn(rows, 1, in_features, dtype=dtype)
            if dtype == torch.float32:
                packer = torch.ops.mkl._mkl_reorder_linear_weight
                packed = lambda: [torch.ops.lit_rl.packed_linear(x, w, None) for w in weights]  # noqa: E731
            else:
                packer = torch.ops.mkldnn._reorder_linear_weight
                onednn = [packer(w, rows) for w in weights]
                packed = lambda: [  # noqa: E731
                    torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in onednn
                ]
            plain = lambda: [F.linear(x, w) for w in weights]  # noqa: E731
            pack = lambda: [packer(w, rows) for w in weights]  # noqa: E731
            times: dict[str, list[float]] = {"f_linear_us": [], "packed_us": [], "pack_us": []}
            with torch.no_grad(), packed_weights():
                for call in (plain, packed, pack):
                    call()  # warm-up (the float32 op packs its weights here)
                for _ in range(rounds):
                    for name, call in (("f_linear_us", plain), ("packed_us", packed), ("pack_us", pack)):
                        times[name].append(timed_us(call) / copies)
            row = {name: statistics.median(values) for name, values in times.items()}
            saved = row["f_linear_us"] - row["packed_us"]
            row |= {
                "dtype": str(dtype).removeprefix("torch."),
                "shape": [out_features, in_features],
                "weight_kib": size / 1024,
                "rows": rows,
                "copies": copies,
                "packed_over_f_linear": row["packed_us"] / row["f_linear_us"],
                "break_even_tokens": row["pack_us"] / saved if saved > 0 else None,
            }
            results.append(row)
    return results


def markdown_table(results: list[dict]) -> str:
    lines = [
        "| weights | shape | KiB | F.linear us | packed us | packed / F.linear | packing us | break-even tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        even = "never" if r["break_even_tokens"] is None else f"{r['break_even_tokens']:.0f}"
        lines.append(
            f"| {r['dtype']} | {r['shape'][0]} x {r['shape'][1]} | {r['weight_kib']:.0f} | {r['f_linear_us']:.1f} "
            f"| {r['packed_us']:.1f} | {r['packed_over_f_linear']:.2f}x | {r['pack_us']:.0f} | {even} |"
        )
    return "\n".join(lines)


def claims(results: list[dict]) -> list[str]:
    lines = []
    for dtype in ("float32", "bfloat16"):
        rows = [r for r in results if r["dtype"] == dtype and r["weight_kib"] >= 512]
        if rows:
            ratios = [r["packed_over_f_linear"] for r in rows]
            evens = [r["break_even_tokens"] for r in rows]
            worst = "never" if None in evens else f"{max(evens):.0f}"
            lines.append(
                f"{dtype}, weights of 512 KiB and more: packed {min(ratios):.2f}x to {max(ratios):.2f}x F.linear's "
                f"time, packing repaid after at most {worst} tokens"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=16, help="rows of a decoding step (completions)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--cycle-mib", type=int, default=128, help="MiB of distinct weights a round cycles through")
    parser.add_argument("--quick", action="store_true", help="two shapes, 8 MiB of weights, one round")
    args = parse_report_args(parser, markdown_table, claims)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    shapes = SHAPES
    if args.quick:
        args.rounds, args.cycle_mib, shapes = 1, 8, [(128, 128), (512, 512)]
    results = measure(args.rows, args.rounds, args.cycle_mib, shapes)
    publish(args, results, markdown_table, claims, workload=vars(args) | {"out": None, "markdown": None})


if __name__ == "__main__":
    main()
