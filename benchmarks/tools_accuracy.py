"""Greedy held-out accuracy of the tools job with asynchronous episodes, and with weights updated in flight, against
the synchronous run, at the same step counts.

    python benchmarks/tools_accuracy.py --out benchmarks/results/tools_accuracy_cpu.json
    python benchmarks/tools_accuracy.py --markdown benchmarks/results/tools_accuracy_cpu.json   # the docs' table

Each run is `lit-rl fit --config configs/grpo_tools.yaml --config configs/rollout/vllm_server.yaml
--model.rollout.engine.launch true` (the calculator's episodes on a vLLM server the run starts), one per mode
(`MODES`): synchronous; `--model.rollout.max_staleness 1`; and that with `--model.rollout.in_flight_updates true`.
Each validates greedily on the built-in held-out tool prompts every 50 steps (the config's `val_check_interval`); the
accuracy is `val/rewards/final_answer_correctness`. One validation moves by a few points from the next, so the
comparison is of the mean over the last `--window` validations (default 3: steps 200 to 300 of the config's 300).
Target (issue 56): each within 3 points of the synchronous mean.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from async_accuracy import fit_and_validate  # noqa: E402
from provenance import parse_report_args, publish  # noqa: E402

TARGET_POINTS = 3.0
ACCURACY = "val/rewards/final_answer_correctness"
ASYNC = ["--model.rollout.max_staleness", "1"]
MODES = {  # mode: the options it adds to the shared command
    "synchronous": [],
    "asynchronous k=1": ASYNC,
    "in flight k=1": [*ASYNC, "--model.rollout.in_flight_updates", "true"],
}


def run_fit(mode: str, steps: int, workdir: Path) -> dict:
    """One `lit-rl fit` of the tools job in `mode`: its held-out accuracy at each validation."""
    options = [
        *("--config", str(REPO / "configs" / "grpo_tools.yaml")),
        *("--config", str(REPO / "configs" / "rollout" / "vllm_server.yaml")),
        *("--model.rollout.engine.launch", "true", *MODES[mode]),
    ]
    name = mode.replace(" ", "_").replace("=", "")
    wall_s, rows = fit_and_validate(mode, name, options, steps, workdir)
    accuracy = [(int(r["step"]), r[ACCURACY]) for r in rows if ACCURACY in r]
    staleness = [r["train/staleness/token_mean"] for r in rows if "train/staleness/token_mean" in r]
    run = {"mode": mode, "options": MODES[mode], "wall_s": wall_s, "val_accuracy": accuracy}
    if staleness:  # in flight: how stale the trained tokens were, on average over the steps
        run["token_staleness_mean"] = statistics.fmean(staleness)
    return run


def compare(runs: list[dict], window: int) -> dict:
    """Each mode's mean accuracy over the last `window` validations (points), against the synchronous run's."""
    steps = [step for step, _ in runs[0]["val_accuracy"]]
    if any([step for step, _ in run["val_accuracy"]] != steps for run in runs) or len(steps) < window:
        raise RuntimeError("the runs validated at different steps, or too few times for the window")
    means = {run["mode"]: 100 * statistics.fmean(value for _, value in run["val_accuracy"][-window:]) for run in runs}
    sync = means["synchronous"]
    return {
        "window_steps": steps[-window:],
        "accuracy": means,
        "difference_points": {mode: mean - sync for mode, mean in means.items() if mode != "synchronous"},
        "target_met": all(abs(mean - sync) <= TARGET_POINTS for mean in means.values()),
    }


def markdown_table(results: dict) -> str:
    """The docs' table of a results file (a test checks the docs carry exactly this)."""
    modes = [run["mode"] for run in results["runs"]]
    by_mode = {run["mode"]: dict(run["val_accuracy"]) for run in results["runs"]}
    lines = ["| step | " + " | ".join(f"accuracy, {mode}" for mode in modes) + " |", "|---" * (len(modes) + 1) + "|"]
    for step in results["comparison"]["window_steps"]:
        lines.append(f"| {step} | " + " | ".join(f"{100 * by_mode[mode][step]:.1f}%" for mode in modes) + " |")
    return "\n".join(lines)


def claims(results: dict) -> list[str]:
    """The docs' prose numbers of a results file."""
    c = results["comparison"]
    window = f"{c['window_steps'][0]}-{c['window_steps'][-1]}"
    parts = ", ".join(f"{mode} {mean:.1f}%" for mode, mean in c["accuracy"].items())
    differences = ", ".join(f"{mode} {points:+.1f}" for mode, points in c["difference_points"].items())
    met = "within" if c["target_met"] else "outside"
    return [
        f"mean greedy held-out accuracy over steps {window}: {parts} ({differences} points, {met} the 3-point target)"
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--window", type=int, default=3, help="validations averaged at the end of each run")
    args = parse_report_args(parser, markdown_table, claims)
    with tempfile.TemporaryDirectory(prefix="lit-rl-tools-accuracy-") as tmp:
        runs = []
        for mode in MODES:
            print(f"running {mode} for {args.steps} steps ...", flush=True)
            runs.append(run_fit(mode, args.steps, Path(tmp)))
            print(f"  {runs[-1]['val_accuracy']} in {runs[-1]['wall_s']:.0f} s", flush=True)
    results = {"runs": runs, "comparison": compare(runs, args.window)}
    publish(args, results, markdown_table, claims)


if __name__ == "__main__":
    main()
