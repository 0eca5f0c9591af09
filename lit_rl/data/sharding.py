"""Rank sharding without a sampler: every rank gets the same number of full batches whatever the data size.

A rank takes `order[rank::world_size]`; when its share runs out, the batches are filled with copies of an index of
weight 0, which losses and metrics ignore. So metrics stay exact for uneven shares, no rank waits in a collective
for a batch another rank does not have, and Lightning (which leaves an IterableDataset's sharding alone) cannot
shard twice, with or without its distributed sampler.
"""

from __future__ import annotations

import math
from typing import Any, Iterator

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
