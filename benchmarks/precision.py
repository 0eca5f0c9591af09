"""bf16 against fp32 on the GRPO demo: what it learns and how fast, `configs/precision/bf16.yaml` against none.

    python benchmarks/precision.py --out benchmarks/results/precision_cpu.json      # the demo's 1000 steps, 3 runs
    python benchmarks/precision.py --quick                                           # fp32 and bf16-mixed, 2 steps
    python benchmarks/precision.py --markdown benchmarks/results/precision_cpu.json  # the docs' table

Each row is one `lit-rl fit --config configs/grpo.yaml` process (the README's demo: the tiny Qwen2 warm start on
the built-in addition task), with `trainer.precision` 32-true (as shipped), bf16-mixed (the overlay) or bf16-true.
Reported: the greedy accuracy on the 256 held-out problems at the last step (`val/rewards/correctness`), its
difference from fp32's in points (target: within 2), the median seconds per step and the run's model-FLOP
utilisation (`perf/mfu` median, against the measured matmul peak of its dtype: `lit_rl/training/flops.py`).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from provenance import parse_report_args, publish  # noqa: E402
from throughput import fit_flags, metric_rows  # noqa: E402

CONFIGS = REPO / "configs"
SETTINGS = {
    "32-true": [],
    "bf16-mixed": ["--config", str(CONFIGS / "precision" / "bf16.yaml")],
    "bf16-true": ["--trainer.precision", "bf16-true"],
}
ACCURACY = "val/rewards/correctness"


def run_one(precision: str, steps: int, workdir: Path) -> dict:
    command = [sys.executable, "-m", "lit_rl.cli", "fit", "--config", str(CONFIGS / "grpo.yaml")]
    command += SETTINGS[precision] + fit_flags(steps, workdir, name=precision)
    command += ["--trainer.val_check_interval", str(min(steps, 50))]  # the demo's, or once at the end
    subprocess.run(command, check=True, cwd=workdir, stdout=subprocess.DEVNULL)
    (log_dir,) = (workdir / precision).glob("version_*")
    rows = metric_rows(log_dir)
    steps_rows = [r for r in rows if "perf/step_s" in r and r["step"] > 1]  # the first step warms up
    validated = [r for r in rows if ACCURACY in r]
    return {
        "precision": precision,
        "steps": steps,
        "accuracy": validated[-1][ACCURACY],
        "accuracy_step": int(validated[-1]["step"]),
        "step_s": statistics.median(r["perf/step_s"] for r in steps_rows),
        "mfu": statistics.median(r["perf/mfu"] for r in steps_rows),
        "tflops": statistics.median(r["perf/tflops"] for r in steps_rows),
    }


def markdown_table(results: list[dict]) -> str:
    """The docs' table of a results file. Its s/step are of runs one after another, not interleaved rounds: no
    speed ratio is drawn from them (`throughput.py` and `train_mfu.py` compare speeds)."""
    fp32 = next(r for r in results if r["precision"] == "32-true")
    lines = [
        "| trainer.precision | greedy held-out accuracy | vs fp32 | s/step (runs one after another) | MFU |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        diff = 100 * (r["accuracy"] - fp32["accuracy"])
        lines.append(
            f"| {r['precision']} | {100 * r['accuracy']:.1f}% (step {r['accuracy_step']}) | {diff:+.1f} points "
            f"| {r['step_s']:.3f} | {100 * r['mfu']:.2g}% |"
        )
    return "\n".join(lines)


def claims(results: list[dict]) -> list[str]:
    fp32 = next(r for r in results if r["precision"] == "32-true")
    out = []
    for r in results:
        if r is not fp32:
            diff = abs(100 * (r["accuracy"] - fp32["accuracy"]))
            out.append(f"{r['precision']}: {diff:.1f} points from fp32 ({'within' if diff <= 2 else 'outside'} 2)")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000, help="optimizer steps per run (the demo's 1000)")
    parser.add_argument("--precisions", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--quick", action="store_true", help="fp32 and bf16-mixed, 2 steps each")
    args = parse_report_args(parser, markdown_table, claims)
    if args.quick:
        args.steps, args.precisions = 2, ["32-true", "bf16-mixed"]
    if "32-true" not in args.precisions:
        args.precisions = ["32-true", *args.precisions]  # the reference every row is compared with
    results = []
    with tempfile.TemporaryDirectory(prefix="lit-rl-precision-") as tmp:
        for precision in args.precisions:
            print(f"running {precision} ({args.steps} steps) ...", flush=True)
            results.append(run_one(precision, args.steps, Path(tmp)))
    publish(args, results, markdown_table, claims, steps=args.steps)


if __name__ == "__main__":
    main()
