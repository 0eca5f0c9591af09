"""Run as a script: `NonFiniteGuard` under a real DeepSpeed ZeRO run on 2 CPU processes (gloo). A 5-weight affine
model (every weight partitioned under ZeRO-3) trains for 5 steps with a checkpoint after each; at `--bad-step`, on
rank 1 only, the gradient of the bias turns NaN while the loss stays finite, so under ZeRO-2/3 the NaN shows only
in the gradient partition of the rank that owns the bias. Each rank writes `rank<r>.json` to OUT: the error it
stopped with, the steps taken and skipped, and the weights (gathered) before and after the bad step and at the end.

    python tests/integration/deepspeed_nonfinite.py OUT --stage 2 --action stop --bad-step 3
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch

from benchmarks.process_exit import exit_without_finalizing
from lit_rl.callbacks import NonFiniteGuard
from lit_rl.training.strategies import (
    DeepSpeedStrategy,
    gathered_parameters,
    settle_zero3_parameters,
)

BAD_RANK = 1


class NaNGradient(torch.autograd.Function):
    """The identity, whose gradient is NaN."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("nan")


class Affine(torch.nn.Module):
    """`x @ weight.T + bias`; with `poison`, the bias gradient is NaN (inside the module's own forward, where ZeRO-3
    has gathered its parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(1, 4))
        self.bias = torch.nn.Parameter(torch.zeros(1))
        self.poison = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = NaNGradient.apply(self.bias) if self.poison else self.bias
        return torch.nn.functional.linear(x, self.weight, bias)


class NaNGradientAtStep(L.LightningModule):
    def __init__(self, bad_step: int) -> None:
        super().__init__()
        self.layer = Affine()
        self.bad_step = bad_step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.layer.poison = self.global_step + 1 == self.bad_step and self.global_rank == BAD_RANK
        return self.layer(batch[0]).pow(2).mean()

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        data = torch.utils.data.TensorDataset(torch.randn(64, 4, generator=torch.Generator().manual_seed(0)))
        return torch.utils.data.DataLoader(data, batch_size=4)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.1)


def gathered_weights(trainer: L.Trainer, module: NaNGradientAtStep) -> list[float]:
    """The model's 5 weights, whole (a collective under ZeRO-3)."""
    settle_zero3_parameters(trainer.strategy)
    with gathered_parameters(module.layer):
        return torch.cat([p.detach().flatten() for p in module.layer.parameters()]).tolist()


class Record(L.Callback):
    """The weights before and after the bad step and at the end, and what the run logged."""

    def __init__(self, bad_step: int) -> None:
        self.bad_step = bad_step
        self.record: dict[str, Any] = {}

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step + 1 == self.bad_step and "before_bad_step" not in self.record:
            self.record["before_bad_step"] = gathered_weights(trainer, pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.bad_step:
            self.record["after_bad_step"] = gathered_weights(trainer, pl_module)

    def _finish(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.record["final"] = gathered_weights(trainer, pl_module)
        self.record["global_step"] = trainer.global_step
        logged = trainer.callback_metrics.get("train/skipped_steps")
        self.record["logged_skipped_steps"] = None if logged is None else float(logged)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._finish(trainer, pl_module)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._finish(trainer, pl_module)  # every rank stops at the same step: a collective is safe here


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--action", required=True)
    parser.add_argument("--bad-step", type=int, default=3)
    args = parser.parse_args(argv)
    out = Path(args.out)
    L.seed_everything(0)
    zero = {"stage": args.stage, "stage3_param_persistence_threshold": 0}  # ZeRO-3: partition every weight
    guard, record = NonFiniteGuard(action=args.action), Record(args.bad_step)
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=out / "checkpoints", filename="{step}", every_n_train_steps=1, save_top_k=-1
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DeepSpeedStrategy(config={"zero_optimization": zero, "train_micro_batch_size_per_gpu": 4}),
        max_steps=5,
        callbacks=[guard, record, checkpoints],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    error = None
    try:
        trainer.fit(NaNGradientAtStep(args.bad_step))
    except Exception as err:  # noqa: BLE001 - reported in the JSON, which the test reads
        error = f"{type(err).__name__}: {err}"
    record.record.update(error=error, skipped_steps=guard.skipped_steps)
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record.record))


if __name__ == "__main__":
    main()
    exit_without_finalizing()  # the records' gathers end just before: see its docstring
