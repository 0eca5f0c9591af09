"""One short summary at the end of `fit`: steps, wall time, the headline metrics, and where the outputs are.

    lit-rl: done, 1000 optimizer steps in 0:09:57
      train/reward 0.9734  train/rewards/correctness 0.875  train/rewards/integer_format 0.9844
      val/reward 0.9789  val/rewards/correctness 0.8789  val/rewards/integer_format 1
      speed      0.141 s/step, 0.0311 TFLOP/s, MFU 8.67% (of measured cpu matmul, float32 peak 0.358 TFLOP/s)
      checkpoint runs/grpo/version_0/checkpoints/last.ckpt
      metrics    runs/grpo/version_0/metrics.csv
      model      runs/grpo/version_0/hf

The values are the last ones logged, the same as the last value of each column of `metrics.csv`.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional, Sequence

import lightning as L
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from rich.console import Console

from lit_rl.algorithms.base import PolicyModule
from lit_rl.callbacks.export import SaveHFPretrained
from lit_rl.callbacks.safety import GracefulStop
from lit_rl.training.metrics import DPO_PAIR_METRICS


def headline_metrics(names: Sequence[str]) -> list[str]:
    """The few metrics (names without the stage prefix, in logged order) worth a line in the summary: the reward and
    its part from each reward function for rollout algorithms (GRPO, RLOO, Online DPO), the loss and preference
    accuracy for DPO, the loss for anything else (SFT)."""
    if "reward" in names:
        return ["reward", *(n for n in names if n.startswith("rewards/") and n not in DPO_PAIR_METRICS)]
    if "rewards/accuracies" in names:
        return ["loss", "rewards/accuracies"]
    return ["loss"] if "loss" in names else []


def display_path(path: Any) -> str:
    """`path` relative to the working directory when it is inside it, else absolute (symbolic links kept)."""
    absolute = os.path.abspath(path)
    relative = os.path.relpath(absolute)
    return absolute if relative.startswith("..") else relative


class RunSummary(Callback):
    """Print the summary above on global rank 0 when `fit` ends, also after an early stop (a signal, `should_stop`);
    nothing after an error. The CLI adds it; it prints whether or not the progress bar is enabled.

    Args:
        metrics: names of the metrics to show, without the stage prefix (`["reward", "kl"]`); None picks a small
            set for the algorithm (`headline_metrics`).
    """

    def __init__(self, metrics: Optional[list[str]] = None) -> None:
        self.metrics = metrics
        self._started = time.monotonic()
        self._first_step = 0
        self._lines: Optional[list[str]] = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._started, self._lines = time.monotonic(), None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._first_step = trainer.global_step  # above 0 in a resumed run

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            self._lines = self.summary_lines(trainer, time.monotonic() - self._started)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Printed here, not in on_fit_end: the progress bar stops (and, without a terminal, prints its last frame)
        # in its teardown, which comes first, so the summary is the last thing on the console.
        if stage == "fit" and self._lines:
            console = Console(soft_wrap=True, highlight=False)  # soft_wrap: long paths stay on one line
            console.print(self._lines[0], style="bold", markup=False)
            for line in self._lines[1:]:
                console.print(line, markup=False)
            self._lines = None

    def summary_lines(self, trainer: L.Trainer, seconds: float) -> list[str]:
        """The summary as lines of text: the header, one line of metrics per stage, then one line per output."""
        status = "stopped early" if trainer.should_stop else "done"
        steps = trainer.global_step - self._first_step
        counted = f"{steps} optimizer step{'' if steps == 1 else 's'}"
        header = f"lit-rl: {status}, {counted} in {timedelta(seconds=round(seconds))}"
        if self._first_step:
            header += f" (resumed at step {self._first_step}, now at step {trainer.global_step})"
        lines = [header]
        logged = {name: float(value) for name, value in trainer.logged_metrics.items()}
        names = self.metrics or headline_metrics([n.removeprefix("train/") for n in logged if n.startswith("train/")])
        for stage in ("train", "val"):
            shown = [f"{key} {logged[key]:.4g}" for key in (f"{stage}/{name}" for name in names) if key in logged]
            if shown:
                lines.append("  " + "  ".join(shown))
        module = trainer.lightning_module  # any LightningModule may run under the CLI; lit-rl's count their throughput
        throughput = module.throughput if isinstance(module, PolicyModule) else None
        if throughput is not None and throughput.steps:
            lines.append(f"  speed      {throughput.summary()}")
        for label, path in outputs(trainer).items():
            # The step a checkpoint holds: `last.ckpt` links to the newest step=N.ckpt, which a run that ends
            # between two saves is past (its `hf/` export holds the end state).
            step = saved_step(path) if label == "checkpoint" else None
            lines.append(f"  {label:<10} {display_path(path)}" + (f" (step {step})" if step is not None else ""))
        return lines


def saved_step(path: str) -> Optional[int]:
    """The optimizer step the checkpoint at `path` was written at, or None when it cannot be read."""
    from lit_rl.resume import checkpoint_step

    try:
        return checkpoint_step(Path(path))
    except Exception:  # a summary line is no place to fail a finished run
        return None


def outputs(trainer: L.Trainer) -> dict[str, str]:
    """Where this run wrote its newest checkpoint, its metrics CSV and its Hugging Face export: only those on disk
    (the CSV logger makes no file until a row is logged: `log_every_n_steps 0`, `max_steps 0`)."""
    found: dict[str, str] = {}
    checkpoint = trainer.checkpoint_callback
    for callback in trainer.callbacks:
        if isinstance(callback, GracefulStop) and callback.checkpoint_path:
            found["checkpoint"] = callback.checkpoint_path  # written on a signal, newer than any other
    if "checkpoint" not in found and checkpoint is not None:
        # `last_model_path` with `save_last`; without a monitor, `best_model_path` is the newest save.
        newest = getattr(checkpoint, "last_model_path", "") or getattr(checkpoint, "best_model_path", "")
        if newest:
            found["checkpoint"] = newest
    for logger in trainer.loggers:
        if isinstance(logger, CSVLogger):
            found["metrics"] = logger.experiment.metrics_file_path
            break
    for callback in trainer.callbacks:
        if isinstance(callback, SaveHFPretrained) and callback.saved_to is not None:
            found["model"] = str(callback.saved_to)
    return {label: path for label, path in found.items() if get_filesystem(path).exists(path)}
