"""Token-budget micro-batches: an optimizer step's completions grouped by tokens instead of a fixed count.

With `model.schedule.micro_batch_tokens: N`, the `micro_batch_size x accumulate_grad_batches` completions one rank
trains on in an optimizer step (the same completions as without it) are grouped into at most `accumulate_grad_batches`
micro-batches of at most N tokens each. A completion's tokens are its real prompt and completion tokens (what a
padding-free forward computes). Units are placed first-fit in decreasing size (a unit is one completion, or the two
completions of an Online DPO pair, which its loss reads together); each micro-batch keeps its rows in buffer
order.

The number of micro-steps per optimizer step stays `accumulate_grad_batches` (Lightning's automatic optimization
counts them), so a step whose completions fit in fewer micro-batches runs the rest empty: a forward of one unit
with its completion and loss masks zeroed, which adds nothing to the loss, the gradient or the metrics, and keeps every
rank's collectives (DDP's all-reduce, ZeRO-3's gathers) in step. Short completions therefore cost fewer real
forwards, and long ones never more than N tokens at once (the forwards at generation time too: old and reference
log-probs and PPO's values go over consecutive rows of at most N tokens, `MicroBatcher.forward_slices`; with
sharded parameters every rank runs as many of them as the rank that needs the most).

A step whose completions need more micro-batches than that is over budget: the units that fit nowhere go to the
micro-batches with the fewest tokens, and `train/micro_batch_tokens/max` (logged with the budget) shows by how
much. Raise `trainer.accumulate_grad_batches` or the budget when it does.

The loss denominators are those of the whole optimizer step (`LossNormalizer`), so the grouping changes which
completions share a forward, never what the step computes: a test checks 1 x 8 = 4 x 2 = token-budgeted.
The grouping is the bin packing of packed rows (`lit_rl.modeling.packing.first_fit_decreasing`) with a cap on the bins.
"""

from __future__ import annotations

import torch

from lit_rl.modeling.packing import first_fit_decreasing
from lit_rl.types import RolloutBatch


def token_budget_micro_batches(unit_tokens: list[int], budget: int, max_micro_batches: int) -> list[list[int]]:
    """Unit indices of each micro-batch (at most `max_micro_batches`, each sorted), first-fit in decreasing
    size into micro-batches of at most `budget` tokens; once `max_micro_batches` are open, a unit that fits in
    none joins the one with the fewest tokens (over budget). Ties keep the units' order."""
    groups = first_fit_decreasing(unit_tokens, budget, max_bins=max_micro_batches)
    return [sorted(group) for group in groups]


def budgeted_micro_batch(
    buffer: RolloutBatch, index: int, rows_per_step: int, accumulate: int, budget: int, unit: int = 1
) -> tuple[RolloutBatch, bool]:
    """Micro-batch `index` of a pass over `buffer` (`rows_per_step` rows per optimizer step, `accumulate`
    micro-steps each) grouped by tokens, and whether it holds completions: a micro-step past the step's last group
    gets the step's first unit with its completion mask, loss mask and advantages zeroed (False)."""
    step, slot = divmod(index, accumulate)
    first = step * rows_per_step  # the step's rows are first .. first + rows_per_step - 1
    tokens = step_row_tokens(buffer, step, rows_per_step)  # [rows_per_step]
    groups = token_budget_micro_batches(tokens.view(-1, unit).sum(dim=1).long().tolist(), budget, accumulate)
    device = buffer.prompt_ids.device
    if slot < len(groups):
        units = torch.tensor(groups[slot], device=device)
        rows = (first + units[:, None] * unit + torch.arange(unit, device=device)).reshape(-1)
        return buffer.select(rows), True
    empty = buffer.select(slice(first, first + unit))
    empty.completion_mask = torch.zeros_like(empty.completion_mask)
    if empty.loss_mask is not None:  # the tokens the loss counts (KL and all): none
        empty.loss_mask = torch.zeros_like(empty.loss_mask)
    empty.advantages = torch.zeros_like(empty.advantages)
    return empty, False


def step_row_tokens(buffer: RolloutBatch, step: int, rows_per_step: int) -> torch.Tensor:
    """Real tokens (prompt and completion) of each row of optimizer `step` in `buffer`: [rows_per_step]."""
    rows = slice(step * rows_per_step, (step + 1) * rows_per_step)
    return buffer.prompt_mask[rows].sum(dim=1) + buffer.completion_mask[rows].sum(dim=1)
