"""LightningDataModules: prompts for rollout algorithms, prompt/completion pairs for SFT.

Rows stay Python dicts until the algorithm tokenizes them (it owns the tokenizer and the chat template); every
other column travels with the prompt to the reward functions (`answer` for the built-in task).
"""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch
from torch.utils.data import DataLoader

from lit_rl.data.files import Row, load_rows, validate_rows
from lit_rl.data.schedule import RolloutSchedule, RolloutScheduleLoader


def collate_rows(rows: list[Row]) -> list[Row]:
    """Keep a batch as a list of row dicts; tokenization happens in the LightningModule."""
    return rows


class PromptDataModule(L.LightningDataModule):
    """Prompts for rollout algorithms (GRPO, ...).

    The training loader follows the algorithm's rollout schedule (`rollout_schedule()` of the LightningModule):
    one item per micro-step, the prompts of a generation on its first micro-step (`lit_rl.data.schedule`).

    Args:
        train_data: `builtin:addition/train` or a local `.jsonl` / `.json` / `.parquet` file with a `prompt`
            column (text, or chat messages `[{"role": ..., "content": ...}]`); other columns go to the rewards.
        val_data: same format, for validation; None disables validation.
        val_limit: use at most this many validation rows (the first ones), None for all.
        val_batch_size: validation prompts per batch on each rank.
        seed: seed of the training prompt order (each epoch is a fresh permutation).
    """

    def __init__(
        self,
        train_data: str = "builtin:addition/train",
        val_data: Optional[str] = "builtin:addition/val",
        val_limit: Optional[int] = None,
        val_batch_size: int = 64,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if val_batch_size < 1:
            raise ValueError(f"data.val_batch_size must be >= 1, got {val_batch_size}")
        self.train_data = train_data
        self.val_data = val_data
        self.val_limit = val_limit
        self.val_batch_size = val_batch_size
        self.seed = seed
        self.train_rows: list[Row] = []
        self.val_rows: list[Row] = []

    required_columns: tuple[str, ...] = ("prompt",)

    def setup(self, stage: Optional[str] = None) -> None:
        if not self.train_rows:
            self.train_rows = load_rows(self.train_data)
            validate_rows(self.train_rows, self.required_columns, self.train_data)
        if self.val_data is not None and not self.val_rows:
            rows = load_rows(self.val_data)
            self.val_rows = rows[: self.val_limit] if self.val_limit is not None else rows
            validate_rows(self.val_rows, self.required_columns, self.val_data)

    def train_dataloader(self) -> RolloutScheduleLoader:
        module = self.trainer.lightning_module
        if not hasattr(module, "rollout_schedule"):
            raise TypeError(f"{type(module).__name__} has no rollout_schedule(): use a prompt/completion DataModule")
        schedule: RolloutSchedule = module.rollout_schedule()
        return RolloutScheduleLoader(
            self.train_rows, schedule, seed=self.seed, rank=self.trainer.global_rank, world_size=self.trainer.world_size
        )

    def val_dataloader(self) -> Any:
        if not self.val_rows:
            return []
        # Its own generator: creating a DataLoader iterator draws a seed from the generator, and drawing it from
        # the global RNG would make a run with validation sample different training rollouts than one without.
        return DataLoader(
            self.val_rows,  # type: ignore[arg-type]
            batch_size=self.val_batch_size,
            collate_fn=collate_rows,
            generator=torch.Generator().manual_seed(self.seed),
        )


class SFTDataModule(PromptDataModule):
    """Prompt/completion pairs for supervised fine-tuning (`prompt` and `completion` columns).

    Args:
        train_data: `builtin:addition/train` or a local file with `prompt` and `completion` columns.
        val_data: same format, for validation; None disables validation.
        val_limit: use at most this many validation rows.
        batch_size: rows per micro-batch on each rank.
        num_workers: DataLoader worker processes.
    """

    required_columns = ("prompt", "completion")

    def __init__(
        self,
        train_data: str = "builtin:addition/train",
        val_data: Optional[str] = "builtin:addition/val",
        val_limit: Optional[int] = None,
        batch_size: int = 64,
        num_workers: int = 0,
    ) -> None:
        super().__init__(train_data=train_data, val_data=val_data, val_limit=val_limit, val_batch_size=batch_size)
        if batch_size < 1:
            raise ValueError(f"data.batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self.num_workers = num_workers

    def _loader(self, rows: list[Row], shuffle: bool) -> DataLoader[Any]:
        return DataLoader(
            rows,  # type: ignore[arg-type]
            batch_size=self.batch_size,
            shuffle=shuffle,
            drop_last=shuffle,
            collate_fn=collate_rows,
            num_workers=self.num_workers,
        )

    def train_dataloader(self) -> DataLoader[Any]:
        return self._loader(self.train_rows, shuffle=True)

    def val_dataloader(self) -> DataLoader[Any]:
        return self._loader(self.val_rows, shuffle=False)
