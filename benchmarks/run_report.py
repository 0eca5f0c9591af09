"""Summarise a training run from its metrics.csv, or run one of the README's demos and write its summary: the
numbers the README quotes.

    python benchmarks/run_report.py runs/grpo/version_0 [--window 50] [--json out.json]   # an existing run
    python benchmarks/run_report.py --demo grpo --json benchmarks/results/grpo_demo.json  # run a demo, summarise
    python benchmarks/run_report.py --markdown benchmarks/results/grpo_demo.json          # the README's table
    python benchmarks/run_report.py --markdown benchmarks/results/rloo_demo.json benchmarks/results/online_dpo_demo.json

For a run: the train/ metrics' means over the first and the last `window` optimizer steps, the median of every
perf/ metric, and every validation row (val/ metrics are logged at the step they were measured).

`--demo NAME` runs the README's commands for a demo in this checkout, one process each, as `python -m lit_rl.cli`
(what `lit-rl` runs), timed from start to exit, and writes one JSON (`--json`): per command its `lit-rl` form, wall
time, log directory and summary, with the commit and dirty flag (benchmarks/provenance.py). The commands:

- every demo: `lit-rl fit --config configs/NAME.yaml`, then `lit-rl validate --config configs/NAME.yaml` (step 0:
  the warm start, which the fit does not validate);
- dpo also: `lit-rl validate --config configs/grpo.yaml`, with and without `--model.policy.model_name_or_path
  runs/dpo/version_N/hf` (the greedy task accuracy of the trained policy and of the warm start).
"""

from __future__ import annotations

import argparse
import csv
import json
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from provenance import add_allow_dirty, check_output, write_report  # noqa: E402

LAST_VALIDATIONS = 8  # the GRPO demo's spread of greedy accuracy over its last validations


@dataclass(frozen=True)
class Step:
    """One `lit-rl` command of a demo; `role` names its summary in the JSON."""

    role: str
    subcommand: str  # fit or validate
    config: str  # relative to the checkout
    trained: bool = False  # validate the policy the demo's fit exported (`<log dir>/hf`)

    def args(self, fit_dir: Optional[str]) -> list[str]:
        model = ["--model.policy.model_name_or_path", f"{fit_dir}/hf"] if self.trained else []
        return [self.subcommand, "--config", self.config, *model]


def _demo(name: str) -> list[Step]:
    config = f"configs/{name}.yaml"
    return [Step("fit", "fit", config), Step("start", "validate", config)]


DEMOS = {
    "grpo": _demo("grpo"),
    "dpo": [
        *_demo("dpo"),
        Step("task_start", "validate", "configs/grpo.yaml"),
        Step("task_end", "validate", "configs/grpo.yaml", trained=True),
    ],
    "rloo": _demo("rloo"),
    "online_dpo": _demo("online_dpo"),
    "ppo": _demo("ppo"),
    "grpo_tools": _demo("grpo_tools"),
    "grpo_reasoning_gym": _demo("grpo_reasoning_gym"),
}


# -- reading a run ------------------------------------------------------------------------------------------------
def load(log_dir: Path) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """The train/ rows and the val/ rows of a run's metrics.csv, as floats, empty cells left out."""
    with open(log_dir / "metrics.csv") as handle:
        rows = [{k: float(v) for k, v in row.items() if v not in ("", None)} for row in csv.DictReader(handle)]
    train = [r for r in rows if any(k.startswith("train/") for k in r)]
    val = [r for r in rows if any(k.startswith("val/") for k in r)]
    return train, val


def summarise(train: list[dict[str, float]], val: list[dict[str, float]], window: int) -> dict:
    """First- and last-`window` means of the train/ metrics, medians of the perf/ ones, and the validation rows."""
    keys = sorted({k for r in train for k in r if k.startswith("train/")})
    perf = sorted({k for r in train for k in r if k.startswith("perf/")})

    def mean(rows, key):
        values = [r[key] for r in rows if key in r]
        return statistics.fmean(values) if values else float("nan")

    first, last = train[:window], train[-window:]
    return {
        "steps": int(max(r["step"] for r in train)) if train else 0,
        "window": window,
        "train_first": {k: mean(first, k) for k in keys},
        "train_last": {k: mean(last, k) for k in keys},
        "perf_median": {k: statistics.median(r[k] for r in train if k in r) for k in perf},
        "val": [{k: v for k, v in r.items() if k == "step" or k.startswith("val/")} for r in val],
    }


# -- running a demo -----------------------------------------------------------------------------------------------
def _log_dirs() -> set[Path]:
    return set((REPO / "runs").glob("*/version_*"))


def run_step(step: Step, fit_dir: Optional[str], window: int) -> dict:
    """Run one command in this checkout, timed; its `lit-rl` form, wall time, log directory and summary."""
    args = step.args(fit_dir)
    before = _log_dirs()
    print(f"running lit-rl {shlex.join(args)} ...", flush=True)
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "lit_rl.cli", *args], cwd=REPO, capture_output=True, text=True)
    wall = time.monotonic() - started
    if result.returncode != 0:
        raise SystemExit(f"run_report.py: error: lit-rl {shlex.join(args)} failed: {result.stderr.strip()[-2000:]}")
    (log_dir,) = _log_dirs() - before
    summary = summarise(*load(log_dir), window)
    out = {"command": shlex.join(["lit-rl", *args]), "wall_s": wall, "log_dir": str(log_dir.relative_to(REPO))}
    if step.subcommand == "validate":
        return out | {"val": summary["val"][-1]}
    config = yaml.safe_load((log_dir / "config.yaml").read_text())
    return out | summary | {"max_steps": config["trainer"]["max_steps"], "model": config["model"]["init_args"]}


def run_demo(name: str, window: int) -> dict:
    """Every command of a demo, in order: the summary the README's tables and numbers are rendered from."""
    report: dict = {"demo": name}
    for step in DEMOS[name]:
        report[step.role] = run_step(step, report.get("fit", {}).get("log_dir"), window)
    return report


# -- the README's tables and numbers --------------------------------------------------------------------------------
def duration(seconds: float) -> str:
    """`52 s`, `1 min 52 s`."""
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s" if minutes else f"{rest} s"


def _grpo_table(r: dict) -> str:
    fit, key = r["fit"], "train/rewards/correctness"
    temperature = fit["model"].get("temperature", 1.0)
    return "\n".join(
        [
            "| | start | end |",
            "|---|---|---|",
            f"| sampled reward accuracy (`{key}`, mean of the first / last {fit['window']} steps, temperature "
            f"{temperature:g}) | {fit['train_first'][key]:.3f} | {fit['train_last'][key]:.3f} |",
            "| greedy accuracy on the 256 held-out prompts (`val/rewards/correctness`) "
            f"| {r['start']['val']['val/rewards/correctness']:.3f} (step 0) "
            f"| {fit['val'][-1]['val/rewards/correctness']:.3f} (step {int(fit['val'][-1]['step'])}) |",
        ]
    )


def _validations_table(r: dict, metrics: list[tuple[str, str, str]]) -> str:
    """A column per validation (step 0, the demo's `validate`, then the fit's), a row per (label, key, format)."""
    rows = [{"step": 0.0, **r["start"]["val"]}, *r["fit"]["val"]]
    return "\n".join(
        [
            "| step | " + " | ".join(str(int(row["step"])) for row in rows) + " |",
            "|---|" + "---|" * len(rows),
            *(
                f"| {label} | " + " | ".join(format(row[key], spec) for row in rows) + " |"
                for label, key, spec in metrics
            ),
        ]
    )


def _tools_table(r: dict) -> str:
    """The tool demo: greedy accuracy and tool use on the held-out prompts at every validation."""
    return _validations_table(
        r,
        [
            ("greedy accuracy (256 held-out prompts)", "val/rewards/final_answer_correctness", ".3f"),
            ("tool calls per episode", "val/tool_calls", ".2f"),
        ],
    )


def _reasoning_gym_table(r: dict) -> str:
    """The reasoning-gym demo: greedy score on the held-out rows at step 0 and every validation."""
    return _validations_table(r, [("greedy score (256 held-out rows, the task's scorer)", "val/rewards/score", ".3f")])


def _dpo_table(r: dict) -> str:
    val, start = r["fit"]["val"], r["start"]["val"]
    accuracy = start["val/rewards/accuracies"]
    task = "val/rewards/correctness"
    return "\n".join(
        [
            "| | start | " + " | ".join(f"step {int(row['step'])}" for row in val) + " |",
            "|---|---|" + "---|" * len(val),
            "| preference accuracy (`val/rewards/accuracies`, 256 held-out pairs) "
            f"| {accuracy:.3f}{' (*)' if accuracy == 0 else ''} | "
            + " | ".join(f"{row['val/rewards/accuracies']:.3f}" for row in val)
            + " |",
            f"| `val/loss` | {start['val/loss']:.3f} | " + " | ".join(f"{row['val/loss']:.3f}" for row in val) + " |",
            f"| greedy task accuracy on the 256 held-out prompts | {r['task_start']['val'][task]:.3f} | "
            + "| " * (len(val) - 1)
            + f"{r['task_end']['val'][task]:.3f} |",
        ]
    )


def _rollout_label(r: dict) -> str:
    group = r["fit"]["model"]["num_generations"]
    if r["demo"] == "rloo":
        return f"k = {group}"
    return f"{group} samples per prompt" + (", a critic" if r["demo"] == "ppo" else "")


def _rollout_table(reports: list[dict]) -> str:
    lines = [
        "| command | wall time | `train/reward` | `train/rewards/correctness` | greedy accuracy |",
        "|---|---|---|---|---|",
    ]
    for r in reports:
        fit = r["fit"]
        first, last = fit["train_first"], fit["train_last"]
        moves = [f"{first[k]:.3f} -> {last[k]:.3f}" for k in ("train/reward", "train/rewards/correctness")]
        greedy = (
            f"{r['start']['val']['val/rewards/correctness']:.3f} -> {fit['val'][-1]['val/rewards/correctness']:.3f}"
        )
        lines.append(
            f"| `{fit['command']}` ({_rollout_label(r)}) | {duration(fit['wall_s'])} | {' | '.join(moves)} | {greedy} |"
        )
    return "\n".join(lines)


def markdown_table(results: Union[dict, list[dict]]) -> str:
    """The README's table of one demo summary (grpo, dpo) or of several (rloo and online_dpo share one table); a
    test checks the README carries exactly this."""
    reports = [results] if isinstance(results, dict) else list(results)
    if reports[0]["demo"] == "grpo":
        return _grpo_table(reports[0])
    if reports[0]["demo"] == "dpo":
        return _dpo_table(reports[0])
    if reports[0]["demo"] == "grpo_tools":
        return _tools_table(reports[0])
    if reports[0]["demo"] == "grpo_reasoning_gym":
        return _reasoning_gym_table(reports[0])
    return _rollout_table(reports)


def _greedy_move(results: dict, what: str, key: str) -> str:
    """`what` from step 0 to the last validation, with the fit's wall time and steps."""
    fit = results["fit"]
    start, end = results["start"]["val"][key], fit["val"][-1][key]
    return (
        f"{what} {start:.3f} -> {end:.3f} ({100 * (end - start):+.1f} points) in "
        f"{duration(fit['wall_s'])} ({fit['steps']} steps)"
    )


def claims(results: dict) -> list[str]:
    """The README's prose numbers of a demo summary (a test checks the README says them)."""
    fit = results["fit"]
    if results["demo"] == "grpo":
        accuracy = [row["val/rewards/correctness"] for row in fit["val"][-LAST_VALIDATIONS:]]
        steps = [int(row["step"]) for row in fit["val"][-LAST_VALIDATIONS:]]
        perf = fit["perf_median"]
        return [
            f"Wall time of the whole command: **{duration(fit['wall_s'])}**",
            f"# step 0: val/rewards/correctness {results['start']['val']['val/rewards/correctness']:.4f}",
            f"moves between {min(accuracy):.3f} and {max(accuracy):.3f} over the last {len(accuracy)} validations "
            f"(steps {steps[0]} to {steps[-1]})",
            f"medians over the {fit['steps']} steps of the GRPO demo: {perf['perf/step_s']:.3f} s per step, "
            f"{perf['perf/generation_s']:.3f} s generation, {perf['perf/policy_update_s']:.3f} s policy update",
        ]
    if results["demo"] == "dpo":
        return [
            f"Wall time of the whole command: **{duration(fit['wall_s'])}**; "
            f"**{fit['perf_median']['perf/step_s']:.3f} s per step** (the median `perf/step_s`)"
        ]
    if results["demo"] == "online_dpo":
        first, last, window = fit["train_first"], fit["train_last"], fit["window"]
        return [
            f"skipped {first['train/frac_tied_pairs']:.0%} of its pairs as ties in the first {window} steps and "
            f"{last['train/frac_tied_pairs']:.0%} in the last {window}"
        ]
    if results["demo"] == "grpo_tools":
        return [_greedy_move(results, "greedy accuracy", "val/rewards/final_answer_correctness")]
    if results["demo"] == "grpo_reasoning_gym":
        return [_greedy_move(results, "greedy score", "val/rewards/score")]
    if results["demo"] == "ppo":
        first, last, window = fit["train_first"], fit["train_last"], fit["window"]
        variance = "train/critic/explained_variance"
        return [
            f"The critic's `{variance}` went from {first[variance]:.3f} (first {window} steps) to "
            f"{last[variance]:.3f} (last {window})",
            f"`critic/values` {first['train/critic/values']:.2f} -> {last['train/critic/values']:.2f}",
            f"{fit['perf_median']['perf/step_s']:.3f} s per step (median `perf/step_s`)",
        ]
    return []


# -- the command line -----------------------------------------------------------------------------------------------
def print_run(report: dict, title: str) -> None:
    """The rich tables of one run's summary."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=160)
    table = Table(title=f"{title}: train/ means over the first and last {report['window']} steps")
    table.add_column("metric")
    table.add_column("first", justify="right")
    table.add_column("last", justify="right")
    for key in report["train_first"]:
        table.add_row(key, f"{report['train_first'][key]:.4f}", f"{report['train_last'][key]:.4f}")
    console.print(table)
    val_keys = sorted({k for r in report["val"] for k in r if k != "step"})
    if val_keys:
        vtable = Table(title="validation")
        vtable.add_column("step", justify="right")
        for key in val_keys:
            vtable.add_column(key, justify="right")
        for row in report["val"]:
            vtable.add_row(str(int(row.get("step", -1))), *(f"{row.get(k, float('nan')):.4f}" for k in val_keys))
        console.print(vtable)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log_dir", type=Path, nargs="?", help="a run's log directory (with metrics.csv)")
    parser.add_argument("--demo", choices=list(DEMOS), default=None, help="run the README's commands of this demo")
    parser.add_argument("--window", type=int, default=50)
    parser.add_argument("--json", type=Path, default=None, help="the summary as JSON (commit, dirty flag, command)")
    parser.add_argument("--markdown", type=Path, nargs="+", default=None, help="print the README's table of summaries")
    add_allow_dirty(parser)
    args = parser.parse_args()
    if args.markdown:
        reports = [json.loads(path.read_text())["results"] for path in args.markdown]
        print(markdown_table(reports))
        for report in reports:
            print("\n".join(claims(report)))
        return
    if (args.log_dir is None) == (args.demo is None):
        parser.error("give a log directory or --demo")
    check_output(args.json, args.allow_dirty)
    if args.demo:
        report = run_demo(args.demo, args.window)
        print_run(report["fit"], f"{args.demo} demo ({report['fit']['log_dir']})")
        print(markdown_table(report))
        print("\n".join(claims(report)))
    else:
        report = summarise(*load(args.log_dir), args.window)
        print_run(report, str(args.log_dir))
    if args.json:
        write_report(args.json, report, allow_dirty=args.allow_dirty)


if __name__ == "__main__":
    main()
