"""LightningDataModules: prompts for rollout algorithms, prompt/completion pairs for SFT.

Rows stay Python dicts until the algorithm tokenizes them (it owns the tokenizer and the chat template); every
other column travels with the prompt to the reward functions (`answer` for the built-in task).
"""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader

from lit_rl.data.contracts import (
    CountsBatches,
    CountsRowTokens,
    EncodesPrompts,
    SchedulesRollouts,
    fed_algorithm,
)
from lit_rl.data.files import Row, load_rows, validate_rows
from lit_rl.data.preference import ShardedPairBatches, TokenizedPair, tokenize_pairs, with_explicit_prompt
from lit_rl.data.schedule import RolloutSchedule, RolloutScheduleLoader
from lit_rl.data.sharding import ShardedRowBatches, ShardedTrainBatches, lightning_windows
from lit_rl.errors import ConfigError


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
            raise ConfigError(f"data.val_batch_size must be >= 1, got {val_batch_size}")
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
            self.train_rows = self.prepare_rows(load_rows(self.train_data))
            validate_rows(self.train_rows, self.required_columns, self.train_data)
        if self.val_data is not None and not self.val_rows:
            rows = self.prepare_rows(load_rows(self.val_data))
            self.val_rows = rows[: self.val_limit] if self.val_limit is not None else rows
            validate_rows(self.val_rows, self.required_columns, self.val_data)

    def prepare_rows(self, rows: list[Row]) -> list[Row]:
        """The rows as loaded, before they are checked for `required_columns`; a subclass may rewrite them."""
        return rows

    def train_dataloader(self) -> RolloutScheduleLoader:
        module = fed_algorithm(self, self.trainer.lightning_module, SchedulesRollouts, SAMPLING_ALGORITHMS)
        schedule: RolloutSchedule = module.rollout_schedule()
        return RolloutScheduleLoader(
            self.train_rows, schedule, seed=self.seed, rank=self.trainer.global_rank, world_size=self.trainer.world_size
        )

    def val_dataloader(self) -> Any:
        if not self.val_rows:
            return []
        batches = ShardedRowBatches(
            self.val_rows, self.val_batch_size, self.trainer.global_rank, self.trainer.world_size
        )
        # Its own generator: creating a DataLoader iterator draws a seed from the generator, and drawing it from
        # the global RNG would move that stream (dropout, the engines' fallback seeds) in a run with validation.
        return DataLoader(batches, batch_size=None, generator=torch.Generator().manual_seed(self.seed))


SAMPLING_ALGORITHMS = "the algorithms that sample (GRPO, PPO, RLOO, OnlineDPO)"
SFT_ALGORITHMS = "supervised fine-tuning (SFT)"
DPO_ALGORITHMS = "the preference algorithms that train on fixed pairs (DPO)"


class SFTDataModule(PromptDataModule):
    """Prompt/completion pairs for supervised fine-tuning (`prompt` and `completion` columns).

    Args:
        train_data: `builtin:addition/train` or a local file with `prompt` and `completion` columns.
        val_data: same format, for validation; None disables validation.
        val_limit: use at most this many validation rows.
        batch_size: rows per micro-batch on each rank (the loader shuffles each epoch with `seed`, shards the rows
            across ranks and resumes where the checkpoint says: `lit_rl.data.sharding.ShardedTrainBatches`).
        seed: seed of the training order (a new permutation each epoch).
        num_workers: ignored since 0.2, kept so that 0.1 configs load: the batches are raw rows, built in the
            trainer's process (the module tokenizes them).
        micro_batch_tokens: regroup each optimizer step's rows into its micro-batches by tokens, at most this
            many prompt and completion tokens each (`lit_rl.data.sharding.ResumableShardBatches`); None: batches
            of `batch_size` rows.
    """

    required_columns = ("prompt", "completion")

    def __init__(
        self,
        train_data: str = "builtin:addition/train",
        val_data: Optional[str] = "builtin:addition/val",
        val_limit: Optional[int] = None,
        batch_size: int = 64,
        seed: int = 0,
        num_workers: Optional[int] = None,
        micro_batch_tokens: Optional[int] = None,
    ) -> None:
        if batch_size < 1:
            raise ConfigError(f"data.batch_size must be >= 1, got {batch_size}")
        check_micro_batch_tokens(micro_batch_tokens)
        if num_workers:
            rank_zero_warn(
                f"data.num_workers={num_workers} is ignored since lit-rl 0.2: batches are built in the "
                "trainer's process; remove the key"
            )
        super().__init__(
            train_data=train_data, val_data=val_data, val_limit=val_limit, val_batch_size=batch_size, seed=seed
        )
        self.batch_size = batch_size
        self.micro_batch_tokens = micro_batch_tokens
        self._row_tokens: Optional[list[int]] = None

    def train_dataloader(self) -> DataLoader[Any]:
        trainer = self.trainer
        module = fed_algorithm(self, trainer.lightning_module, CountsBatches, SFT_ALGORITHMS)
        if self.micro_batch_tokens is not None and self._row_tokens is None:
            counting = fed_algorithm(self, module, CountsRowTokens, SFT_ALGORITHMS)
            self._row_tokens = counting.row_tokens(self.train_rows)  # as the module will tokenize them
        batches = ShardedTrainBatches(
            self.train_rows,
            self.batch_size,
            self.seed,
            trainer.global_rank,
            trainer.world_size,
            start_batch=lambda: module.train_batches_done,  # checkpointed by the algorithm
            windows=lambda: lightning_windows(trainer, len(batches)),
            micro_batch_tokens=self.micro_batch_tokens,
            item_tokens=self._row_tokens,
        )
        return DataLoader(batches, batch_size=None)

    def val_dataloader(self) -> DataLoader[Any]:
        trainer = self.trainer
        batches = ShardedRowBatches(self.val_rows, self.batch_size, trainer.global_rank, trainer.world_size)
        return DataLoader(batches, batch_size=None)


class PreferenceDataModule(PromptDataModule):
    """Preference pairs for DPO: `prompt`, `chosen`, `rejected` (text, or chat messages). Rows with `chosen` and
    `rejected` alone hold the prompt in both, as their shared start: it is taken out as TRL's `extract_prompt` does
    (`lit_rl.data.preference.with_explicit_prompt`).

    Tokenized once in `setup` with the algorithm's tokenizer; batches are sharded across ranks by
    `lit_rl.data.preference.ShardedPairBatches` (uneven shares padded with weight-0 pairs).

    Args:
        train_data: `builtin:addition_preference/train` or a local `.jsonl` / `.json` / `.parquet` file.
        val_data: same format, for validation; None disables validation.
        val_limit: use at most this many validation rows.
        batch_size: pairs per micro-batch on each rank (each pair is two sequences).
        max_prompt_length: keep the last `max_prompt_length` prompt tokens (None: no limit).
        max_length: cut completions so that prompt + completion fits (None: no limit).
        seed: seed of the training order (a new permutation each epoch).
        micro_batch_tokens: regroup each optimizer step's pairs into its micro-batches by tokens, at most this
            many tokens each (a pair's two sequences; `lit_rl.data.sharding.ResumableShardBatches`); None: batches
            of `batch_size` pairs.
    """

    required_columns = ("prompt", "chosen", "rejected")

    def __init__(
        self,
        train_data: str = "builtin:addition_preference/train",
        val_data: Optional[str] = "builtin:addition_preference/val",
        val_limit: Optional[int] = None,
        batch_size: int = 32,
        max_prompt_length: Optional[int] = None,
        max_length: Optional[int] = None,
        seed: int = 0,
        micro_batch_tokens: Optional[int] = None,
    ) -> None:
        if batch_size < 1:
            raise ConfigError(f"data.batch_size must be >= 1, got {batch_size}")
        check_micro_batch_tokens(micro_batch_tokens)
        self.micro_batch_tokens = micro_batch_tokens
        super().__init__(
            train_data=train_data, val_data=val_data, val_limit=val_limit, val_batch_size=batch_size, seed=seed
        )
        self.batch_size = batch_size
        self.max_prompt_length = max_prompt_length
        self.max_length = max_length
        self.train_pairs: list[TokenizedPair] = []
        self.val_pairs: list[TokenizedPair] = []

    def prepare_rows(self, rows: list[Row]) -> list[Row]:
        """Rows without a `prompt` get the one implicit in `chosen` and `rejected` (TRL's implicit prompt)."""
        return [with_explicit_prompt(row) for row in rows]

    def setup(self, stage: Optional[str] = None) -> None:
        super().setup(stage)
        prompts = fed_algorithm(self, self.trainer.lightning_module, EncodesPrompts, DPO_ALGORITHMS).prompt_encoder
        tokenize = lambda rows, source: tokenize_pairs(  # noqa: E731
            rows, prompts.tokenizer, prompts.format, self.max_prompt_length, self.max_length, source
        )
        if not self.train_pairs:
            self.train_pairs = tokenize(self.train_rows, self.train_data)
        if self.val_rows and not self.val_pairs:
            self.val_pairs = tokenize(self.val_rows, self.val_data)

    def _batches(self, pairs: list[TokenizedPair], shuffle: bool) -> DataLoader[Any]:
        trainer = self.trainer
        module = fed_algorithm(self, trainer.lightning_module, CountsBatches, DPO_ALGORITHMS)
        budget = self.micro_batch_tokens if shuffle else None  # training only
        batches = ShardedPairBatches(
            pairs,
            self.batch_size,
            shuffle,
            self.seed,
            trainer.global_rank,
            trainer.world_size,
            pad_id=module.tokenizer.pad_token_id,
            # Training resumes from the algorithm's checkpointed count of consumed batches.
            start_batch=(lambda: module.train_batches_done) if shuffle else (lambda: 0),
            windows=(lambda: lightning_windows(trainer, len(batches))) if shuffle else None,
            micro_batch_tokens=budget,
            item_tokens=None if budget is None else [pair.num_tokens for pair in pairs],
        )
        return DataLoader(batches, batch_size=None)

    def train_dataloader(self) -> DataLoader[Any]:
        return self._batches(self.train_pairs, shuffle=True)

    def val_dataloader(self) -> Any:
        return self._batches(self.val_pairs, shuffle=False) if self.val_pairs else []


def check_micro_batch_tokens(value: Optional[int]) -> None:
    if value is not None and value < 1:
        raise ConfigError(f"data.micro_batch_tokens must be >= 1 (or null), got {value}")
