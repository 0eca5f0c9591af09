"""The micro-steps of an on-policy module's buffer: which rows each micro-batch holds (by count, or by tokens with
`model.schedule.micro_batch_tokens`, after the ranks' rows are dealt evenly by tokens), the loss denominators of each
optimizer step summed over ranks, and forwards over the buffer a micro-batch at a time.

`MicroBatcher` is a part the module holds (`OnPolicyModule.micro_batcher`): plain settings and functions of the
batches it is given; what it needs of the run (the ranks, a gather) comes as arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from lit_rl.losses import LossNormalizer
from lit_rl.training.micro_batches import budgeted_micro_batch, step_row_tokens
from lit_rl.training.rank_balance import balanced_rows, exchange_rows
from lit_rl.training.strategies import reduce_across_ranks
from lit_rl.types import RolloutBatch


@dataclass(frozen=True)
class MicroBatcher:
    """How a generation's buffer is cut into micro-steps.

    Args:
        micro_batch_size: rows per micro-batch (`model.schedule.micro_batch_size`).
        accumulate: micro-batches per optimizer step (`trainer.accumulate_grad_batches`).
        micro_batch_tokens: cut each step's rows by tokens instead of by count (None: by count).
        unit: consecutive rows that stay together (Online DPO: a pair's two completions).
    """

    micro_batch_size: int
    accumulate: int
    micro_batch_tokens: Optional[int] = None
    unit: int = 1

    @property
    def rows_per_step(self) -> int:
        """Rows one rank trains on per optimizer step."""
        return self.accumulate * self.micro_batch_size

    def micro_batch(self, buffer: RolloutBatch, index: int) -> tuple[RolloutBatch, bool]:
        """Micro-batch `index` of one pass over `buffer`, and whether it holds completions: `micro_batch_size`
        consecutive rows, or with `micro_batch_tokens` the step's rows grouped by tokens
        (`lit_rl.training.micro_batches.budgeted_micro_batch`, which may give an empty micro-step: False)."""
        size = self.micro_batch_size
        if self.micro_batch_tokens is None:
            return buffer.select(slice(index * size, (index + 1) * size)), True
        return budgeted_micro_batch(
            buffer, index, self.rows_per_step, self.accumulate, self.micro_batch_tokens, self.unit
        )

    def per_micro_batch(
        self,
        batch: RolloutBatch,
        score: Callable[[RolloutBatch], torch.Tensor],
        most_on_any_rank: Optional[Callable[[int], int]] = None,
    ) -> torch.Tensor:
        """`score(micro-batch)` [n, T] over `batch` in slices of consecutive rows (`forward_slices`), concatenated
        and zeroed where the completion mask is 0 (the forwards at generation time: old and reference log-probs,
        PPO's values).

        Slices by tokens may number differently on each rank. Where every forward is a collective (sharded
        parameters), `most_on_any_rank(count)` gives the most slices any rank has, and this rank runs its missing
        forwards on its first row, their results unused, so that every rank runs as many."""
        slices = self.forward_slices(batch)
        missing = 0
        if most_on_any_rank is not None and self.micro_batch_tokens is not None:  # before any forward's collective
            missing = most_on_any_rank(len(slices)) - len(slices)
        chunks = [score(batch.select(rows)) for rows in slices]
        for _ in range(missing):
            score(batch.select(slice(0, 1)))
        return torch.cat(chunks) * batch.completion_mask

    def forward_slices(self, batch: RolloutBatch) -> list[slice]:
        """The rows of each forward over `batch` at generation time: `micro_batch_size` at a time, or with
        `micro_batch_tokens` as many consecutive rows as hold at most that many real tokens (one row at least),
        so that these forwards keep to the budget the training's do."""
        if self.micro_batch_tokens is None:
            size = self.micro_batch_size
            return [slice(start, start + size) for start in range(0, len(batch), size)]
        tokens = (batch.prompt_mask.sum(dim=1) + batch.completion_mask.sum(dim=1)).tolist()  # [N]
        slices, start, held = [], 0, 0
        for row, row_tokens in enumerate(tokens):
            if row > start and held + row_tokens > self.micro_batch_tokens:
                slices.append(slice(start, row))
                start, held = row, 0
            held += row_tokens
        return slices + [slice(start, len(tokens))] if tokens else slices

    def step_normalizers(self, batch: RolloutBatch, completion_budget: int, world_size: int) -> list[LossNormalizer]:
        """Loss denominators for each optimizer step of `batch` (a generation, its `loss_mask` set), summed over
        ranks."""
        per_step = self.rows_per_step
        loss_tokens = batch.loss_mask.sum(dim=1)  # [N]: each row's tokens in the loss
        active = (batch.advantages != 0).float()  # [N]
        counts = torch.stack(
            [chunk.sum() for chunk in loss_tokens.split(per_step)]
            + [loss_tokens.sum()]
            + [chunk.sum() for chunk in active.split(per_step)]
        )
        counts = reduce_across_ranks(counts) if world_size > 1 else counts
        steps = len(range(0, len(batch), per_step))
        num_sequences = float(per_step * world_size)
        return [
            LossNormalizer(
                num_sequences,
                float(counts[i]),
                float(counts[steps]),
                completion_budget,
                num_active_sequences=float(counts[steps + 1 + i]),
            )
            for i in range(steps)
        ]

    def balanced_across_ranks(
        self,
        batch: RolloutBatch,
        gather_stacked: Callable[[torch.Tensor], torch.Tensor],
        world_size: int,
        rank: int,
        pad_token_id: int,
    ) -> RolloutBatch:
        """This rank's share of the generation once each step's rows are dealt evenly by tokens (`rank_balance`);
        every rank keeps its number of rows per step, so the normalizers computed before still hold.
        `gather_stacked(tensor)`: every rank's tensor, stacked [world, ...]."""
        tokens = batch.prompt_mask.sum(dim=1) + batch.completion_mask.sum(dim=1)  # [N]
        all_tokens = gather_stacked(tokens)  # [world, N]
        rows, _ = balanced_rows(all_tokens.cpu(), world_size, rank, self.rows_per_step, self.unit)
        return exchange_rows(batch, rows, gather_stacked, pad_token_id)

    def step_tokens(self, buffer: RolloutBatch, step: int) -> torch.Tensor:
        """The tokens of this rank's rows of optimizer `step` of `buffer`."""
        return step_row_tokens(buffer, step, self.rows_per_step).sum()
