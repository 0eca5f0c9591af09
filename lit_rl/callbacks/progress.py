"""A rich progress bar that counts optimizer steps in a step-bounded run and shows the step first.

Lightning's bar counts micro-batches from the start of the epoch against `max_steps - global_step`: with gradient
accumulation it read 12/6 at step 6, and after a resume at step 299 of 1000, 1000/701.

Without a terminal (nohup, SLURM, `| tee`, a CI log) rich draws nothing until the run ends; the bar then prints
what it shows as a plain line instead, at the first step and then at most every `line_every_s` seconds:

    step 120/1000  train/loss -0.0123  train/reward 0.8125  0.139 s/step  ETA 0:02:02
"""

from __future__ import annotations

import math
import time
from datetime import timedelta
from typing import Any, Optional

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.callbacks.progress.rich_progress import RichProgressBarTheme


class StepProgressBar(RichProgressBar):
    """Lightning's `RichProgressBar`, counting optimizer steps; without a terminal, plain lines instead.

    Args:
        refresh_rate: as `RichProgressBar`'s.
        leave: as `RichProgressBar`'s.
        theme: as `RichProgressBar`'s.
        console_kwargs: as `RichProgressBar`'s.
        line_every_s: without a terminal, the least number of seconds between two plain lines (the first comes at
            the first step).
    """

    def __init__(
        self,
        refresh_rate: int = 100,
        leave: bool = False,
        theme: RichProgressBarTheme = RichProgressBarTheme(),
        console_kwargs: Optional[dict[str, Any]] = None,
        line_every_s: float = 30.0,
    ) -> None:
        super().__init__(refresh_rate=refresh_rate, leave=leave, theme=theme, console_kwargs=console_kwargs)
        self.line_every_s = line_every_s
        self._prints_lines = False  # no terminal for rich to draw in
        self._batches = 0  # this fit's, for the pace of an epoch-bounded run
        self._last_line: tuple[float, int] = (0.0, 0)  # (time, steps or batches) of the last line, or of the start
        self._printed = False

    def counts_steps(self) -> bool:
        """Whether the run is bounded by `max_steps` alone (`max_epochs` -1): the bar then counts the run's steps."""
        trainer = self.trainer
        return trainer.max_epochs is not None and trainer.max_epochs < 0 and (trainer.max_steps or 0) > 0

    @property
    def total_train_batches(self) -> int | float:
        if self.counts_steps():
            return self.trainer.max_steps
        return super().total_train_batches

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        console = self._console  # rich's test of whether its live display refreshes
        draws = console is not None and (console.is_jupyter or (console.is_terminal and not console.is_dumb_terminal))
        self._prints_lines = self.is_enabled and not draws
        self._batches, self._printed = 0, False
        self._last_line = (time.monotonic(), trainer.global_step if self.counts_steps() else 0)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        if self.counts_steps() and self.progress is not None and self.train_progress_bar_id is not None:
            self.progress.update(self.train_progress_bar_id, completed=trainer.global_step)  # a resumed run

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # Lightning's bar shows `batch_idx + 1`: pass the step count in its place.
        shown = trainer.global_step - 1 if self.counts_steps() else batch_idx
        super().on_train_batch_end(trainer, pl_module, outputs, batch, shown)
        self._batches += 1
        if self._prints_lines:
            self._print_line(trainer, pl_module, shown + 1)

    def _print_line(self, trainer: L.Trainer, pl_module: L.LightningModule, position: int) -> None:
        """The bar as one line, at the first step and then after the first step that ends `line_every_s` after the
        last line; its pace (seconds per step, or per batch of an epoch-bounded run) is the one since that line."""
        steps = self.counts_steps()
        done = trainer.global_step if steps else self._batches
        now = time.monotonic()
        last_time, last_done = self._last_line
        if done == last_done or (self._printed and now - last_time < self.line_every_s):
            return  # inside an accumulation window, or too soon
        seconds = (now - last_time) / (done - last_done)
        self._last_line, self._printed = (now, done), True
        total, unit = self.total_train_batches, "step" if steps else "batch"
        parts = [f"{unit} {position}/{int(total) if math.isfinite(total) else '?'}"]
        if not steps:
            parts.insert(0, self._get_train_description(trainer.current_epoch).strip())
        metrics = self.get_metrics(trainer, pl_module)
        metrics.pop("step", None)
        parts += [
            f"{name} {value:.4g}" if isinstance(value, float) else f"{name} {value}" for name, value in metrics.items()
        ]
        parts.append(f"{seconds:.3g} s/{unit}")
        if math.isfinite(total):
            left = timedelta(seconds=round(seconds * max(total - position, 0)))
            parts.append(f"ETA {left}" if steps else f"epoch ETA {left}")
        print("  ".join(parts), flush=True)  # a file's stdout is block-buffered: the line shows now

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        metrics.pop("step", None)  # the float copy logged for the CSV x-axis
        return {"step": str(trainer.global_step), **metrics}

    # A private method of Lightning's: tests/test_compat.py checks it is still called.
    def _get_train_description(self, current_epoch: int) -> str:
        # Step-bounded runs have max_epochs == -1; show "Epoch 3", not "Epoch 3/-2".
        if self.trainer.max_epochs is not None and self.trainer.max_epochs < 0:
            description = f"Epoch {current_epoch}"
            return f"{description:{len(self.validation_description)}}"
        return super()._get_train_description(current_epoch)
