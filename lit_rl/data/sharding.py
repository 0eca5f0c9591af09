"""Rank sharding without a sampler: every rank gets the same number of full batches whatever the data size.

A rank takes `order[rank::world_size]`; when its share runs out, the batches are filled with copies of an index of
weight 0, which losses and metrics ignore. So metrics stay exact for uneven shares, no rank waits in a collective
for a batch another rank does not have, and Lightning (which leaves an IterableDataset's sharding alone) cannot
shard twice, with or without its distributed sampler.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils.data import IterableDataset

from lit_rl.data.files import Row
from lit_rl.errors import ConfigError
from lit_rl.training.micro_batches import token_budget_micro_batches


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The permutation of `range(n)` for `epoch`: the same on every rank and on every resume."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def num_shard_batches(n: int, batch_size: int, world_size: int) -> int:
    """Batches per rank: enough for the largest share."""
    return math.ceil(math.ceil(n / world_size) / batch_size)


def shard_batches(
    order: list[int], batch_size: int, rank: int, world_size: int
) -> Iterator[tuple[list[int], list[float]]]:
    """This rank's batches of `order[rank::world_size]` as (indices, weights), padded with weight-0 copies."""
    shard = order[rank::world_size]
    num_batches = num_shard_batches(len(order), batch_size, world_size)
    filler = shard[0] if shard else order[0]
    padded = shard + [filler] * (num_batches * batch_size - len(shard))
    for start in range(0, len(padded), batch_size):
        chunk = padded[start : start + batch_size]
        yield chunk, [1.0 if start + i < len(shard) else 0.0 for i in range(len(chunk))]


class ShardedRowBatches(IterableDataset):
    """Unshuffled batches of raw rows (`{"rows": [...], "weight": [B]}`) sharded like `shard_batches`: the
    validation loader of rollout algorithms, whose metrics weigh padding rows 0 (exact under any world size)."""

    def __init__(self, rows: list[Row], batch_size: int, rank: int, world_size: int) -> None:
        self.rows, self.batch_size, self.rank, self.world_size = rows, batch_size, rank, world_size

    def __len__(self) -> int:
        return num_shard_batches(len(self.rows), self.batch_size, self.world_size)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for indices, weights in shard_batches(list(range(len(self.rows))), self.batch_size, self.rank, self.world_size):
            yield {"rows": [self.rows[i] for i in indices], "weight": torch.tensor(weights)}


@dataclass(frozen=True)
class StepWindows:
    """How Lightning groups a run's training batches into optimizer steps: epochs of `epoch_batches` batches
    (`trainer.num_training_batches`: the loader's length, or `limit_train_batches`), each cut into windows of
    `accumulate` batches (`trainer.accumulate_grad_batches`, read at the epoch's start, so that a
    `GradientAccumulationScheduler` is followed), the last window ending with the epoch.

    A batch is named by its position in the run (the count of batches consumed before it), so windows stay where
    Lightning puts them across epochs and resumes.
    """

    epoch_batches: int
    accumulate: int = 1

    def epoch_end(self, position: int) -> int:
        """The position after the last batch of the epoch that holds `position`."""
        return (position // self.epoch_batches + 1) * self.epoch_batches

    def window(self, position: int) -> range:
        """The positions of the optimizer step that holds `position`."""
        epoch_start = position - position % self.epoch_batches
        start = epoch_start + (position - epoch_start) // self.accumulate * self.accumulate
        return range(start, min(start + self.accumulate, self.epoch_end(position)))


def lightning_windows(trainer: Any, num_batches: int) -> StepWindows:
    """The `StepWindows` of `trainer`'s fit now. DeepSpeed counts its accumulation over the whole run, not per
    epoch: an epoch that is not a whole number of optimizer steps would carry a step across epochs there, while
    Lightning counts one per epoch, so it is refused."""
    limit = trainer.num_training_batches
    epoch_batches = num_batches if not math.isfinite(limit) else max(1, min(int(limit), num_batches))
    accumulate = trainer.accumulate_grad_batches
    if trainer.strategy.handles_gradient_accumulation and epoch_batches % accumulate:
        raise ConfigError(
            f"trainer.accumulate_grad_batches={accumulate} does not divide the {epoch_batches} training batches of an "
            "epoch: under DeepSpeed a partial optimizer step would run into the next epoch while Lightning counts "
            "it in this one. Set trainer.limit_train_batches (or data.batch_size) so that it does"
        )
    return StepWindows(epoch_batches, accumulate)


class ResumableShardBatches(IterableDataset):
    """Batches of this rank's share of `num_items` items (indices and weights, as `shard_batches`), shuffled anew
    each pass over the data with `seed` (or in order), that resume where the run is.

    `start_batch()` is the run's position: how many training batches it has consumed (the algorithm's checkpointed
    counter). Iteration starts there, in the permutation of pass `start_batch() // len(self)`, and ends with
    Lightning's epoch (`windows()`), so a resumed run sees exactly the batches an uninterrupted one would have.
    Each batch comes with its optimizer step's batches (`StepWindows.window`): a loss normalised by the whole
    step's items needs to count them before the step's later batches arrive.

    With `micro_batch_tokens` (and each item's `item_tokens`), the real items of an optimizer step are grouped
    anew into its micro-batches by tokens (`lit_rl.training.micro_batches.token_budget_micro_batches`: at most as
    many as the step has, of at most that many tokens each, first-fit in decreasing size): the same items per step,
    fewer padded tokens and a bounded forward. A micro-batch left without items holds one item of weight 0, which
    adds nothing to the loss or the metrics.
    """

    def __init__(
        self,
        num_items: int,
        batch_size: int,
        shuffle: bool,
        seed: int,
        rank: int,
        world_size: int,
        start_batch: Callable[[], int] = lambda: 0,
        windows: Optional[Callable[[], StepWindows]] = None,
        micro_batch_tokens: Optional[int] = None,
        item_tokens: Optional[list[int]] = None,
    ) -> None:
        self.num_items, self.batch_size, self.shuffle, self.seed = num_items, batch_size, shuffle, seed
        self.rank, self.world_size, self.start_batch = rank, world_size, start_batch
        self.windows = windows or (lambda: StepWindows(len(self)))
        if micro_batch_tokens is not None and item_tokens is None:
            raise ValueError("micro_batch_tokens needs the items' token counts (item_tokens)")
        self.micro_batch_tokens, self.item_tokens = micro_batch_tokens, item_tokens
        self._grouped: Optional[tuple[int, list[list[int]]]] = None  # (a step's first position, its micro-batches)
        self._passes: dict[int, list[tuple[list[int], list[float]]]] = {}

    def __len__(self) -> int:
        return num_shard_batches(self.num_items, self.batch_size, self.world_size)

    def batch_at(self, position: int) -> tuple[list[int], list[float]]:
        """(indices, weights) of the run's batch at `position`."""
        data_pass, index = divmod(position, len(self))
        if data_pass not in self._passes:
            order = epoch_order(self.num_items, self.seed, data_pass) if self.shuffle else list(range(self.num_items))
            # Keep this pass and the one before: a step's window can span the boundary of two passes.
            self._passes = {p: b for p, b in self._passes.items() if p == data_pass - 1}
            self._passes[data_pass] = list(shard_batches(order, self.batch_size, self.rank, self.world_size))
        return self._passes[data_pass][index]

    def positions(self) -> Iterator[tuple[int, StepWindows]]:
        """The positions of this epoch's batches from the run's position on, with the epoch's windows."""
        start, windows = self.start_batch(), self.windows()
        for position in range(start, windows.epoch_end(start)):
            yield position, windows

    def window_batches(self, position: int, windows: StepWindows) -> list[tuple[list[int], list[float]]]:
        """(indices, weights) of every batch of the optimizer step that holds `position`."""
        return [self.batch_at(p) for p in windows.window(position)]

    def micro_batch_at(self, position: int, windows: StepWindows) -> tuple[list[int], list[float]]:
        """(indices, weights) the run trains on at `position`: the batch, or with a token budget this place's share
        of its optimizer step's real items."""
        if self.micro_batch_tokens is None:
            return self.batch_at(position)
        window = windows.window(position)
        if self._grouped is None or self._grouped[0] != window.start:  # grouped once per step
            items = [
                i for indices, weights in self.window_batches(position, windows) for i, w in zip(indices, weights) if w
            ]
            groups = token_budget_micro_batches(
                [self.item_tokens[i] for i in items], self.micro_batch_tokens, len(window)
            )
            self._grouped = (window.start, [[items[j] for j in group] for group in groups])
        groups = self._grouped[1]
        place = position - window.start
        if place < len(groups):
            return groups[place], [1.0] * len(groups[place])
        return [self.batch_at(window.start)[0][0]], [0.0]  # nothing left for this micro-batch


class ShardedTrainBatches(ResumableShardBatches):
    """Shuffled training batches of raw rows (`{"rows": [...], "weight": [B], "window_rows": [...]}`), sharded like
    `shard_batches` and resumable (`ResumableShardBatches`). `window_rows` are the real rows of this rank in the
    optimizer step that holds the batch, for SFT's loss, normalised by the step's tokens (`lit_rl.algorithms.sft`).
    """

    def __init__(self, rows: list[Row], batch_size: int, seed: int, rank: int, world_size: int, **resume: Any) -> None:
        super().__init__(len(rows), batch_size, True, seed, rank, world_size, **resume)
        self.rows = rows

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for position, windows in self.positions():
            indices, weights = self.micro_batch_at(position, windows)
            window_rows = [
                self.rows[i]
                for window_indices, window_weights in self.window_batches(position, windows)
                for i, weight in zip(window_indices, window_weights)
                if weight > 0
            ]
            yield {"rows": [self.rows[i] for i in indices], "weight": torch.tensor(weights), "window_rows": window_rows}
