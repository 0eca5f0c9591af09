"""A rich progress bar that counts optimizer steps in a step-bounded run and shows the step first.

Lightning's bar counts micro-batches from the start of the epoch against `max_steps - global_step`: with gradient
accumulation it read 12/6 at step 6, and after a resume at step 299 of 1000, 1000/701.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar


class StepProgressBar(RichProgressBar):
    def counts_steps(self) -> bool:
        """Whether the run is bounded by `max_steps` alone (`max_epochs` -1): the bar then counts the run's steps."""
        trainer = self.trainer
        return trainer.max_epochs is not None and trainer.max_epochs < 0 and (trainer.max_steps or 0) > 0

    @property
    def total_train_batches(self) -> int | float:
        if self.counts_steps():
            return self.trainer.max_steps
        return super().total_train_batches

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
