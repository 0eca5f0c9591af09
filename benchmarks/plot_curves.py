"""Training curves from a run's metrics.csv: reward and loss against the optimizer step, train and validation.

    python benchmarks/plot_curves.py runs/grpo/version_0 --out docs/img/grpo_curves.png

Train values are drawn as a moving average over `--smooth` steps (the raw per-step values are faint behind it);
validation points are drawn where they were measured. Needs matplotlib (`pip install -e ".[bench]"`).
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path


def _series(rows: list[dict[str, str]], key: str) -> tuple[list[float], list[float]]:
    points = [(float(r["step"]), float(r[key])) for r in rows if r.get(key) not in (None, "")]
    return [p[0] for p in points], [p[1] for p in points]


def _moving_average(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot(log_dir: Path, out: Path, reward_key: str, val_key: str, loss_key: str, smooth: int, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(log_dir / "metrics.csv") as handle:
        rows = list(csv.DictReader(handle))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    steps, values = _series(rows, reward_key)
    left.plot(steps, values, color="tab:blue", alpha=0.2, linewidth=0.8)
    left.plot(steps, _moving_average(values, smooth), color="tab:blue", label=f"{reward_key} ({smooth}-step mean)")
    val_steps, val_values = _series(rows, val_key)
    if val_steps:
        left.plot(val_steps, val_values, "o-", color="tab:orange", label=val_key)
    left.set_xlabel("optimizer step")
    left.set_ylabel(reward_key.split("/", 1)[-1])
    left.legend(loc="lower right")
    left.grid(alpha=0.3)
    steps, values = _series(rows, loss_key)
    right.plot(steps, values, color="tab:green", alpha=0.2, linewidth=0.8)
    right.plot(steps, _moving_average(values, smooth), color="tab:green", label=f"{loss_key} ({smooth}-step mean)")
    val_loss_steps, val_loss = _series(rows, loss_key.replace("train/", "val/"))
    if val_loss_steps:
        right.plot(val_loss_steps, val_loss, "o-", color="tab:red", label=loss_key.replace("train/", "val/"))
    right.set_xlabel("optimizer step")
    right.set_ylabel("loss")
    right.legend(loc="upper right")
    right.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log_dir", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reward", default="train/rewards/correctness", help="train metric on the left panel")
    parser.add_argument("--val", default="val/rewards/correctness", help="validation metric on the left panel")
    parser.add_argument("--loss", default="train/loss")
    parser.add_argument("--smooth", type=int, default=25)
    parser.add_argument("--title", default=None)
    args = parser.parse_args()
    plot(args.log_dir, args.out, args.reward, args.val, args.loss, args.smooth, args.title or str(args.log_dir))
    print(args.out)


if __name__ == "__main__":
    main()
