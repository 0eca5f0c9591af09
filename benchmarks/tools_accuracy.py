"""Greedy held-out accuracy of the tools job with asynchronous episodes, and with weights updated in flight, against
the synchronous run, at the same step counts, over several seeds.

    python benchmarks/tools_accuracy.py --seeds 0 1 2 --latency-s 0.3 --out benchmarks/results/tools_accuracy_cpu.json
    python benchmarks/tools_accuracy.py --markdown benchmarks/results/tools_accuracy_cpu.json   # the docs' table

Each run is `lit-rl fit --config configs/grpo_tools.yaml --config configs/rollout/vllm_server.yaml
--model.rollout.engine.launch true --seed_everything S` (the calculator's episodes on a vLLM server the run starts),
one per mode (`MODES`) and seed: synchronous; `--model.rollout.max_staleness 1`; and that with
`--model.rollout.in_flight_updates true`. With `--latency-s L` the calculator answers after L seconds
(`SlowCalculator`, a sandbox's round trip), so that episodes outlast a step and in-flight updates reach their later
turns; without it, on a fast machine, in flight samples what fixed-lag asynchronous episodes sample. Each run
validates greedily on the built-in held-out tool prompts every 50 steps (the config's `val_check_interval`); the
accuracy is `val/rewards/final_answer_correctness`. One validation moves by a few points from the next, so a run's
accuracy is its mean over the last `--window` validations (default 3: steps 200 to 300 of the config's 300), and a
mode's is the mean over its seeds. Target (issue 56): each mode within 3 points of the synchronous mean.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from async_accuracy import fit_and_validate  # noqa: E402
from provenance import parse_report_args, publish  # noqa: E402

from lit_rl.envs.tools import ToolEnvironment  # noqa: E402

TARGET_POINTS = 3.0
ACCURACY = "val/rewards/final_answer_correctness"
ASYNC = ["--model.rollout.max_staleness", "1"]
MODES = {  # mode: the options it adds to the shared command
    "synchronous": [],
    "asynchronous k=1": ASYNC,
    "in flight k=1": [*ASYNC, "--model.rollout.in_flight_updates", "true"],
}


class SlowCalculator(ToolEnvironment):
    """The tools job's calculator, answering each call after `latency_s` seconds (`--latency-s`)."""

    def __init__(self, tools: Optional[list[Any]] = None, latency_s: float = 0.3, timeout_s: float = 5.0) -> None:
        super().__init__(tools=tools, timeout_s=timeout_s)
        self.latency_s = latency_s

    def step(self, completion: str) -> Any:
        time.sleep(self.latency_s)
        return super().step(completion)


def run_fit(mode: str, seed: int, latency_s: float, steps: int, workdir: Path) -> dict:
    """One `lit-rl fit` of the tools job in `mode` with `seed`: its held-out accuracy at each validation."""
    options = [
        *("--config", str(REPO / "configs" / "grpo_tools.yaml")),
        *("--config", str(REPO / "configs" / "rollout" / "vllm_server.yaml")),
        *("--model.rollout.engine.launch", "true", "--seed_everything", str(seed), *MODES[mode]),
    ]
    if latency_s > 0:
        options += ["--model.env.environment", "tools_accuracy.SlowCalculator"]
        options += ["--model.env.environment_args", f"{{latency_s: {latency_s}}}"]
    name = f"{mode.replace(' ', '_').replace('=', '')}_seed{seed}"
    wall_s, rows = fit_and_validate(f"{mode}, seed {seed}", name, options, steps, workdir)
    accuracy = [(int(r["step"]), r[ACCURACY]) for r in rows if ACCURACY in r]
    staleness = [r["train/staleness/token_mean"] for r in rows if "train/staleness/token_mean" in r]
    run = {"mode": mode, "seed": seed, "options": MODES[mode], "wall_s": wall_s, "val_accuracy": accuracy}
    if staleness:  # in flight: how stale the trained tokens were, on average over the steps
        run["token_staleness_mean"] = statistics.fmean(staleness)
    return run


def compare(runs: list[dict], window: int) -> dict:
    """Each run's mean accuracy over its last `window` validations (points); each mode's mean over its seeds,
    against the synchronous mode's."""
    steps = [step for step, _ in runs[0]["val_accuracy"]]
    if any([step for step, _ in run["val_accuracy"]] != steps for run in runs) or len(steps) < window:
        raise RuntimeError("the runs validated at different steps, or too few times for the window")
    per_seed: dict[str, dict[str, float]] = {}
    for run in runs:
        points = 100 * statistics.fmean(value for _, value in run["val_accuracy"][-window:])
        per_seed.setdefault(run["mode"], {})[str(run["seed"])] = points
    means = {mode: statistics.fmean(seeds.values()) for mode, seeds in per_seed.items()}
    sync = means["synchronous"]
    return {
        "window_steps": steps[-window:],
        "per_seed": per_seed,
        "accuracy": means,
        "difference_points": {mode: mean - sync for mode, mean in means.items() if mode != "synchronous"},
        "target_met": all(abs(mean - sync) <= TARGET_POINTS for mean in means.values()),
    }


def markdown_table(results: dict) -> str:
    """The docs' table of a results file (a test checks the docs carry exactly this): per mode, each seed's mean
    accuracy over the window, and the mean over seeds."""
    c = results["comparison"]
    seeds = list(next(iter(c["per_seed"].values())))
    window = f"{c['window_steps'][0]}-{c['window_steps'][-1]}"
    lines = [
        f"| mode (accuracy over steps {window}) | " + " | ".join(f"seed {seed}" for seed in seeds) + " | mean |",
        "|---" * (len(seeds) + 2) + "|",
    ]
    for mode, by_seed in c["per_seed"].items():
        cells = " | ".join(f"{by_seed[seed]:.1f}%" for seed in seeds)
        lines.append(f"| {mode} | {cells} | {c['accuracy'][mode]:.1f}% |")
    return "\n".join(lines)


def claims(results: dict) -> list[str]:
    """The docs' prose numbers of a results file."""
    c = results["comparison"]
    window = f"{c['window_steps'][0]}-{c['window_steps'][-1]}"
    parts = ", ".join(f"{mode} {mean:.1f}%" for mode, mean in c["accuracy"].items())
    differences = ", ".join(f"{mode} {points:+.1f}" for mode, points in c["difference_points"].items())
    met = "within" if c["target_met"] else "outside"
    seeds = len(next(iter(c["per_seed"].values())))
    return [
        f"mean greedy held-out accuracy over steps {window} and {seeds} seeds: {parts} ({differences} points, {met} "
        "the 3-point target)"
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--window", type=int, default=3, help="validations averaged at the end of each run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="each mode runs once per seed")
    parser.add_argument("--latency-s", type=float, default=0.0, help="the calculator answers after this long")
    args = parse_report_args(parser, markdown_table, claims)
    # The runs import SlowCalculator from this folder.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "benchmarks"), os.environ.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory(prefix="lit-rl-tools-accuracy-") as tmp:
        runs = []
        for seed in args.seeds:
            for mode in MODES:
                print(f"running {mode}, seed {seed}, for {args.steps} steps ...", flush=True)
                runs.append(run_fit(mode, seed, args.latency_s, args.steps, Path(tmp)))
                print(f"  {runs[-1]['val_accuracy']} in {runs[-1]['wall_s']:.0f} s", flush=True)
    results = {"latency_s": args.latency_s, "runs": runs, "comparison": compare(runs, args.window)}
    publish(args, results, markdown_table, claims)


if __name__ == "__main__":
    main()
