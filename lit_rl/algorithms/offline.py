"""What the algorithms that train on a fixed dataset (DPO, SFT) share: their place in the data, checkpointed so
a resumed run reads exactly the batches an uninterrupted one would have, and their metrics logged once per
optimizer step (training) and once per validation."""

from __future__ import annotations

from typing import Any

import torch
from torchmetrics import MetricCollection

from lit_rl.algorithms.base import PolicyModule
from lit_rl.data.contracts import BatchesByTokens, FixedBatches
from lit_rl.training.metrics import data_token_budget_metrics
from lit_rl.training.strategies import is_accumulating_micro_batch


class OfflineModule(PolicyModule):
    train_metrics: MetricCollection  # set by the subclass
    val_metrics: MetricCollection
    # Batches of the training loader consumed so far: its resumable loader starts there
    # (`lit_rl.data.preference.ShardedPairBatches`, `lit_rl.data.sharding.ShardedTrainBatches`).
    train_batches_done: int = 0

    def training_loss(self, batch: Any) -> torch.Tensor:
        raise NotImplementedError

    def setup(self, stage: str) -> None:
        super().setup(stage)
        # Token-budget micro-batches are the data module's choice (`data.micro_batch_tokens`), known only once the
        # trainer holds it: their size is then logged as the on-policy algorithms log theirs.
        data = self.trainer.datamodule
        budget = data.micro_batch_tokens if isinstance(data, BatchesByTokens) else None
        if budget is not None and "micro_batch_tokens/max" not in self.train_metrics:
            self.train_metrics.add_metrics(data_token_budget_metrics())

    def data_layout(self, trainer: Any, datamodule: Any) -> dict[str, Any]:
        """`train_batches_done` counts batches of `data.batch_size` rows too."""
        layout = super().data_layout(trainer, datamodule)
        if isinstance(datamodule, FixedBatches):
            layout["data.batch_size"] = datamodule.batch_size
        return layout

    def count_micro_batch_tokens(self, tokens: torch.Tensor) -> None:
        """Record a training micro-batch's real prompt and completion tokens (with a token budget)."""
        if "micro_batch_tokens/max" in self.train_metrics:
            self.train_metrics["micro_batch_tokens/max"].update(tokens)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.training_loss(batch)
        # Counted here, not in `on_train_batch_end`: ModelCheckpoint saves in its own `on_train_batch_end`, which
        # Lightning calls before the module's, and the checkpoint must count this batch as read.
        self.train_batches_done += 1
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if is_accumulating_micro_batch(self.trainer):
            return
        self.log_collection(self.train_metrics, on_step=True, prog_bar=("loss",))
        self.log_timings()

    def on_validation_epoch_end(self) -> None:
        self.log_collection(self.val_metrics, on_step=False, prog_bar=("loss",))
        self.log_validated_step()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["lit_rl"] = {"train_batches_done": self.train_batches_done}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self.train_batches_done = checkpoint.get("lit_rl", {}).get("train_batches_done", 0)
