"""The micro-steps of an on-policy module's buffer: which rows each micro-batch holds (by count, or by tokens with
`model.schedule.micro_batch_tokens`, after the ranks' rows are dealt evenly by tokens), the loss denominators of each
optimizer step summed over ranks, and forwards over the buffer a micro-batch at a time.

`MicroBatching` is a mixin of `OnPolicyModule`; it reads the module's `_buffer`, `accumulate`, `micro_batch_tokens`,
`micro_batch_unit`, `completion_budget`, `loss_mask`, `train_metrics`, `tokenizer`, `trainer`, `schedule_args`, and
Lightning's `all_gather` and `global_rank`.
"""

from __future__ import annotations

from typing import Any

import torch

from lit_rl.losses import LossNormalizer
from lit_rl.training.micro_batches import budgeted_micro_batch, step_row_tokens
from lit_rl.training.rank_balance import balanced_rows, exchange_rows
from lit_rl.training.strategies import reduce_across_ranks
from lit_rl.types import RolloutBatch


class MicroBatching:
    """How an on-policy module cuts its buffer into micro-steps (module docstring)."""

    def _balanced_across_ranks(self, batch: RolloutBatch) -> RolloutBatch:
        """This rank's share of the generation once each step's rows are dealt evenly by tokens (`rank_balance`);
        every rank keeps its number of rows per step, so the normalizers computed before still hold."""
        tokens = batch.prompt_mask.sum(dim=1) + batch.completion_mask.sum(dim=1)  # [N]
        all_tokens = self.all_gather(tokens).reshape(self.trainer.world_size, -1)  # [world, N]
        rows, _ = balanced_rows(
            all_tokens.cpu(),
            self.trainer.world_size,
            self.global_rank,
            self.accumulate * self.schedule_args.micro_batch_size,
            self.micro_batch_unit,
        )
        return exchange_rows(batch, rows, self.gather_stacked, self.tokenizer.pad_token_id)

    def gather_stacked(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor`, stacked: [world, ...] (also with one rank)."""
        return self.all_gather(tensor).reshape(self.trainer.world_size, *tensor.shape)

    def per_micro_batch(self, batch: RolloutBatch, score: Any) -> torch.Tensor:
        """`score(micro-batch)` [n, T] over `batch` in `micro_batch_size` slices, concatenated and zeroed where the
        completion mask is 0 (the forwards at generation time: old and reference log-probs, PPO's values)."""
        size = self.schedule_args.micro_batch_size
        chunks = [score(batch.select(slice(start, start + size))) for start in range(0, len(batch), size)]
        return torch.cat(chunks) * batch.completion_mask

    def _step_normalizers(self, batch: RolloutBatch) -> list[LossNormalizer]:
        """Loss denominators for each optimizer step of this generation, summed over ranks."""
        per_step = self.accumulate * self.schedule_args.micro_batch_size
        tokens = self.loss_mask(batch).sum(dim=1)  # [N]
        active = (batch.advantages != 0).float()  # [N]
        counts = torch.stack(
            [chunk.sum() for chunk in tokens.split(per_step)]
            + [tokens.sum()]
            + [chunk.sum() for chunk in active.split(per_step)]
        )
        counts = reduce_across_ranks(counts) if self.trainer.world_size > 1 else counts
        steps = len(range(0, len(batch), per_step))
        num_sequences = float(per_step * self.trainer.world_size)
        return [
            LossNormalizer(
                num_sequences,
                float(counts[i]),
                float(counts[steps]),
                self.completion_budget,
                num_active_sequences=float(counts[steps + 1 + i]),
            )
            for i in range(steps)
        ]

    def _update_rank_tokens(self, step: int) -> None:
        """The tokens of this rank's rows of optimizer `step` of the buffer, into the per-step max and min (synced
        over ranks, they are the most and the fewest any rank trained on)."""
        total = step_row_tokens(self._buffer, step, self.accumulate * self.schedule_args.micro_batch_size).sum()
        self.train_metrics["rank_tokens/max"].update(total)
        self.train_metrics["rank_tokens/min"].update(total)

    def micro_batch(self, index: int) -> tuple[RolloutBatch, bool]:
        """Micro-batch `index` of one pass over the buffer, and whether it holds completions: `micro_batch_size`
        consecutive rows, or with `micro_batch_tokens` the step's rows grouped by tokens
        (`lit_rl.training.micro_batches.budgeted_micro_batch`, which may give an empty micro-step: False)."""
        size = self.schedule_args.micro_batch_size
        if self.micro_batch_tokens is None:
            return self._buffer.select(slice(index * size, (index + 1) * size)), True
        return budgeted_micro_batch(
            self._buffer, index, size * self.accumulate, self.accumulate, self.micro_batch_tokens, self.micro_batch_unit
        )
