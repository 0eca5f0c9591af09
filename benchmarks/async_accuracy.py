"""Greedy held-out accuracy of GRPO with asynchronous rollouts against the synchronous run, at the same step counts.

    python benchmarks/async_accuracy.py --out benchmarks/results/async_accuracy_cpu.json
    python benchmarks/async_accuracy.py --markdown benchmarks/results/async_accuracy_cpu.json   # the README's table

Each run is `lit-rl fit --config configs/grpo.yaml --config configs/rollout/vllm_server.yaml`, the second with
`--model.rollout.max_staleness 1`, against one vLLM server the script starts (every run pushes its own weights before
its first generation). Both validate greedily on the built-in held-out prompts every 50 steps (the config's
`val_check_interval`); the accuracy is `val/rewards/correctness`. One validation moves by several points from the
next in either run, so the comparison is of the mean over the last `--window` validations (default 5: steps 800 to
1000 of the 1000). Target (issue: asynchronous rollouts): the asynchronous mean within 3 points of the synchronous.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from provenance import parse_report_args, publish  # noqa: E402
from throughput import metric_rows  # noqa: E402

from lit_rl.modeling.models import resolve_model_path  # noqa: E402
from lit_rl.rollout.server.client import LocalVLLMServer  # noqa: E402

CONFIGS = REPO / "configs"
TARGET_POINTS = 3.0


def fit_and_validate(label: str, name: str, options: list[str], steps: int, workdir: Path) -> tuple[float, list[dict]]:
    """`lit-rl fit <options>` for `steps` steps, with no checkpoint and no progress bar, logged to `workdir/name`:
    its wall time and its metric rows; a failure raises naming `label`. What both accuracy scripts run."""
    command = [
        *(sys.executable, "-m", "lit_rl.cli", "fit", *options),
        *("--trainer.max_steps", str(steps), "--trainer.enable_checkpointing", "false"),
        *("--trainer.callbacks", "null", "--trainer.enable_progress_bar", "false"),
        *("--trainer.logger.init_args.save_dir", str(workdir), "--trainer.logger.init_args.name", name),
    ]
    started = time.monotonic()
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{label}: {result.stderr.strip()[-2000:]}")
    return time.monotonic() - started, metric_rows(max((workdir / name).glob("version_*")))


def run_fit(staleness: int, server_url: str, steps: int, workdir: Path) -> dict:
    options = [
        *("--config", str(CONFIGS / "grpo.yaml"), "--config", str(CONFIGS / "rollout" / "vllm_server.yaml")),
        *("--model.rollout.engine.server_url", server_url),
        *(["--model.rollout.max_staleness", str(staleness)] if staleness else []),
    ]
    wall_s, rows = fit_and_validate(f"k={staleness}", f"k{staleness}", options, steps, workdir)
    val = [(int(r["step"]), r["val/rewards/correctness"]) for r in rows if "val/rewards/correctness" in r]
    return {"max_staleness": staleness, "wall_s": wall_s, "val_correctness": val}


def compare(runs: list[dict], window: int) -> dict:
    sync, stale = runs
    steps = [step for step, _ in sync["val_correctness"]]
    if steps != [step for step, _ in stale["val_correctness"]] or len(steps) < window:
        raise RuntimeError("the two runs validated at different steps, or too few times for the window")
    means = [100 * statistics.fmean(value for _, value in run["val_correctness"][-window:]) for run in runs]
    return {
        "window_steps": steps[-window:],
        "sync_accuracy": means[0],
        "async_accuracy": means[1],
        "difference_points": means[1] - means[0],
        "target_met": abs(means[1] - means[0]) <= TARGET_POINTS,
    }


def markdown_table(results: dict) -> str:
    """The README's table of a results file (a test checks the README carries exactly this)."""
    runs = {run["max_staleness"]: dict(run["val_correctness"]) for run in results["runs"]}
    lines = ["| step | accuracy, k=0 | accuracy, k=1 |", "|---|---|---|"]
    for step in results["comparison"]["window_steps"]:
        lines.append(f"| {step} | {100 * runs[0][step]:.1f}% | {100 * runs[1][step]:.1f}% |")
    return "\n".join(lines)


def claims(results: dict) -> list[str]:
    """The README's prose numbers of a results file."""
    c = results["comparison"]
    met = "within" if c["target_met"] else "outside"
    return [
        f"mean greedy held-out accuracy over steps {c['window_steps'][0]}-{c['window_steps'][-1]}: "
        f"{c['sync_accuracy']:.1f}% synchronous, {c['async_accuracy']:.1f}% with max_staleness 1 "
        f"({c['difference_points']:+.1f} points, {met} the 3-point target)"
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--window", type=int, default=5, help="validations averaged at the end of each run")
    args = parse_report_args(parser, markdown_table, claims)
    with tempfile.TemporaryDirectory(prefix="lit-rl-async-accuracy-") as tmp:
        model = resolve_model_path("lit-rl/tiny-qwen2-addition-sft")
        server = LocalVLLMServer(model, str(Path(tmp) / "server.log"))
        try:
            runs = []
            for staleness in (0, 1):
                print(f"running k={staleness} for {args.steps} steps ...", flush=True)
                runs.append(run_fit(staleness, server.url, args.steps, Path(tmp)))
        finally:
            server.stop()
    results = {"runs": runs, "comparison": compare(runs, args.window)}
    publish(args, results, markdown_table, claims)


if __name__ == "__main__":
    main()
