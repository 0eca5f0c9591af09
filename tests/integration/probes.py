"""Callbacks for tests: at the end of training, each rank writes what it ran with, as JSON."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L


class _Probe(L.Callback):
    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)

    def write(self, name: str, rank: int, value: dict) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / f"{name}_rank{rank}.json").write_text(json.dumps(value))


class RecordEnginePlacement(_Probe):
    """`engine_rank<r>.json`: the colocated engine's `describe()` (read from vLLM's own state)."""

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.write("engine", trainer.global_rank, pl_module.rollout_engine.describe())


class RecordPrecision(_Probe):
    """`precision_rank<r>.json`: the policy's parameter dtype, the dtype its forward computes in under the
    trainer's precision, and (GRPO) the resolved `rollout_is_correction`."""

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        import torch

        ids = torch.tensor([[1, 2, 3]], device=pl_module.device)
        with torch.no_grad(), trainer.precision_plugin.forward_context():
            logits = pl_module.policy(input_ids=ids).logits
        resolve = getattr(pl_module, "rollout_is_correction", None)
        self.write(
            "precision",
            trainer.global_rank,
            {
                "parameters": str(next(pl_module.policy.parameters()).dtype).removeprefix("torch."),
                "logits": str(logits.dtype).removeprefix("torch."),
                "rollout_is_correction": resolve() if callable(resolve) else None,
            },
        )
