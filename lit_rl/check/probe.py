"""The callback every run of `lit-rl check` carries: it stops the run after a given step the way a user's Ctrl-C
or a pre-emption does (SIGTERM, answered by `lit_rl.callbacks.GracefulStop`), and writes the parameters the run
ended with, for the pair's comparison."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from torchmetrics import MetricCollection

from lit_rl.training.metrics import reductions

PARAMETERS_FILE = "parameters.pt"
REDUCTIONS_FILE = "reductions.json"  # how each logged train/ metric is reduced (lit_rl.training.metrics.reductions)
INITIAL_PARAMETERS_FILE = "initial_parameters.pt"  # written by a run that starts at step 0


class CheckProbe(L.Callback):
    def __init__(self, directory: str, stop_at_step: Optional[int] = None) -> None:
        self.directory = Path(directory)
        self.stop_at_step = stop_at_step
        self.started_at_step = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.started_at_step = trainer.global_step  # the resumed run, started by the same config, goes on
        if trainer.global_step == 0:
            self._save(trainer, INITIAL_PARAMETERS_FILE)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if step == self.stop_at_step and step > self.started_at_step and trainer.is_global_zero:
            self.stop_at_step = None  # once: the rest of the accumulation window must not signal again
            os.kill(os.getpid(), signal.SIGTERM)  # GracefulStop, after this callback, stops at this step

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._save(trainer, PARAMETERS_FILE)
        metrics = getattr(pl_module, "train_metrics", None)
        if trainer.is_global_zero and isinstance(metrics, MetricCollection):
            (self.directory / REDUCTIONS_FILE).write_text(json.dumps(reductions(metrics), indent=1))

    def _save(self, trainer: L.Trainer, name: str) -> None:
        state = trainer.strategy.lightning_module_state_dict()  # whole on every strategy that can gather it
        if trainer.is_global_zero:
            self.directory.mkdir(parents=True, exist_ok=True)
            parameters = {
                key: value.detach().float().cpu() for key, value in state.items() if value.is_floating_point()
            }
            torch.save({"step": trainer.global_step, "parameters": parameters}, self.directory / name)
