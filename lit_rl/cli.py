"""`lit-rl`: LightningCLI over the algorithms and data modules.

    lit-rl fit --config configs/grpo.yaml --model.beta 0.04 --trainer.max_steps 50
    lit-rl fit --config configs/grpo.yaml --print_config
    lit-rl fit --model.help lit_rl.algorithms.GRPO      # every option of an algorithm, with its documentation
"""

from __future__ import annotations

import os
from typing import Any, Optional

import lightning as L
from lightning.pytorch.callbacks import Callback, ProgressBar
from lightning.pytorch.cli import LightningCLI

from lit_rl.callbacks import StepProgressBar


class LitRLCLI(LightningCLI):
    """LightningCLI with lit-rl defaults: any LightningModule/DataModule by class path, configs overwritable,
    and a rich progress bar that shows the optimizer step (unless `--trainer.enable_progress_bar false`)."""

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]) -> L.Trainer:
        configured = list(config.get("callbacks") or []) + callbacks
        wants_bar = config.get("enable_progress_bar") is not False
        if wants_bar and not any(isinstance(cb, ProgressBar) for cb in configured):
            callbacks = [*callbacks, StepProgressBar()]
        return super()._instantiate_trainer(config, callbacks)


def main(args: Optional[list[str]] = None) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    LitRLCLI(
        model_class=L.LightningModule,
        datamodule_class=L.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
        auto_configure_optimizers=False,
    )


if __name__ == "__main__":
    main()
