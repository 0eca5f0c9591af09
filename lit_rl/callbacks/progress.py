"""A rich progress bar that shows the optimizer step (Lightning's bar counts micro-batches) first."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar


class StepProgressBar(RichProgressBar):
    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        metrics.pop("step", None)  # the float copy logged for the CSV x-axis
        return {"step": str(trainer.global_step), **metrics}

    # A private method of Lightning's: lit_rl.training.compat.overridden_private_methods checks it is still called.
    def _get_train_description(self, current_epoch: int) -> str:
        # Step-bounded runs have max_epochs == -1; show "Epoch 3", not "Epoch 3/-2".
        if self.trainer.max_epochs is not None and self.trainer.max_epochs < 0:
            description = f"Epoch {current_epoch}"
            return f"{description:{len(self.validation_description)}}"
        return super()._get_train_description(current_epoch)
