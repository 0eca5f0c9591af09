"""Rank sharding without a sampler: every rank gets the same number of full batches whatever the data size.

A rank takes `order[rank::world_size]`; when its share runs out, the batches are filled with copies of an index of
weight 0, which losses and metrics ignore. So metrics stay exact for uneven shares, no rank waits in a collective
for a batch another rank does not have, and Lightning (which leaves an IterableDataset's sharding alone) cannot
shard twice, with or without its distributed sampler.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import IterableDataset

from lit_rl.data.files import Row


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


class ShardedTrainBatches(IterableDataset):
    """Shuffled training batches of raw rows (`{"rows": [...], "weight": [B], "window_rows": [...]}`), sharded like
    `shard_batches` and resumable like `lit_rl.data.preference.ShardedPairBatches`: iteration starts at
    `start_batch()` (the algorithm's checkpointed count of consumed batches) in the permutation of its epoch.

    `window_rows` are the real rows of this rank in the accumulation window (the `accumulate` batches of one
    optimizer step) that holds the batch: a loss normalised by the whole step's tokens needs them before the
    window's other batches arrive (`lit_rl.algorithms.sft`).
    """

    def __init__(
        self,
        rows: list[Row],
        batch_size: int,
        seed: int,
        rank: int,
        world_size: int,
        start_batch: Callable[[], int] = lambda: 0,
        accumulate: int = 1,
    ) -> None:
        self.rows, self.batch_size, self.seed, self.rank, self.world_size = rows, batch_size, seed, rank, world_size
        self.start_batch, self.accumulate = start_batch, accumulate

    def __len__(self) -> int:
        return num_shard_batches(len(self.rows), self.batch_size, self.world_size)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        epoch, skip = divmod(self.start_batch(), len(self))
        order = epoch_order(len(self.rows), self.seed, epoch)
        batches = list(shard_batches(order, self.batch_size, self.rank, self.world_size))
        for index, (indices, weights) in enumerate(batches[skip:], start=skip):
            window = index // self.accumulate * self.accumulate
            window_rows = [
                self.rows[i]
                for window_indices, window_weights in batches[window : window + self.accumulate]
                for i, weight in zip(window_indices, window_weights)
                if weight > 0
            ]
            yield {"rows": [self.rows[i] for i in indices], "weight": torch.tensor(weights), "window_rows": window_rows}
