"""Summarise a training run from its metrics.csv: the numbers the README quotes.

    python benchmarks/run_report.py runs/grpo/version_0 [--window 50] [--json out.json]

Prints, for the train/ metrics, the mean over the first and the last `window` optimizer steps, and every
validation row (val/ metrics are logged at the step they were measured).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
from pathlib import Path

from rich.console import Console
from rich.table import Table


def load(log_dir: Path) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    with open(log_dir / "metrics.csv") as handle:
        rows = [{k: float(v) for k, v in row.items() if v not in ("", None)} for row in csv.DictReader(handle)]
    train = [r for r in rows if any(k.startswith("train/") for k in r)]
    val = [r for r in rows if any(k.startswith("val/") for k in r)]
    return train, val


def summarise(train: list[dict[str, float]], val: list[dict[str, float]], window: int) -> dict:
    keys = sorted({k for r in train for k in r if k.startswith("train/")})

    def mean(rows, key):
        values = [r[key] for r in rows if key in r]
        return statistics.fmean(values) if values else float("nan")

    first, last = train[:window], train[-window:]
    return {
        "steps": int(max(r["step"] for r in train)) if train else 0,
        "window": window,
        "train_first": {k: mean(first, k) for k in keys},
        "train_last": {k: mean(last, k) for k in keys},
        "val": [{k: v for k, v in r.items() if k == "step" or k.startswith("val/")} for r in val],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log_dir", type=Path)
    parser.add_argument("--window", type=int, default=50)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    report = summarise(*load(args.log_dir), args.window)
    console = Console(width=160)
    table = Table(title=f"{args.log_dir}: train/ means over the first and last {args.window} steps")
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
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
