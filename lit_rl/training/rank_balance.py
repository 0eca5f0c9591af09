"""Token budgets balanced across ranks: each optimizer step's completions dealt so that every rank trains on about
as many tokens as the others.

Each rank samples the completions of its own prompts, so with lengths that vary one rank can hold far more
tokens than another, and every rank waits for the slowest at the step's gradient all-reduce. With
`model.schedule.micro_batch_tokens` on more than one rank, a generation's rows are re-dealt after scoring: for each
optimizer step, the step's rows of all ranks (prompt plus completion tokens each; Online DPO's pairs whole) go
largest first to the rank with the fewest tokens so far among those with room left, so that every rank keeps
its count of rows (Lightning's micro-steps and the loss denominators, which are the step's over all ranks, do not
change). The rows move with everything the loss needs (log-probs, advantages, rewards); the step's loss and
metrics are sums over the same rows on all ranks, so they are unchanged (`tests/integration/test_rank_invariance.py`).

The exchange gathers every rank's buffer on every rank (an all-gather, then each rank keeps its rows): simple, and
small next to a step's activations at today's sizes, but it grows with the ranks; an all-to-all of only the rows
each rank takes is the next step for many ranks. Pure torch; the gather is the caller's (`LightningModule.all_gather`).
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Callable

import torch

from lit_rl.types import RolloutBatch, fill, layout


def balanced_assignment(tokens: list[int], world: int) -> list[list[int]]:
    """Deal units of `tokens` (`world * k` of them) to `world` ranks, `k` each: the largest first (ties: the
    lower index) to the rank with the fewest tokens among those with room left (ties: the lower rank). Each
    rank's unit indices, ascending."""
    if len(tokens) % world:
        raise ValueError(f"{len(tokens)} units do not split evenly over {world} ranks")
    room = len(tokens) // world
    dealt: list[list[int]] = [[] for _ in range(world)]
    totals = [0] * world
    for unit in sorted(range(len(tokens)), key=lambda i: (-tokens[i], i)):
        rank = min((r for r in range(world) if len(dealt[r]) < room), key=lambda r: (totals[r], r))
        dealt[rank].append(unit)
        totals[rank] += tokens[unit]
    return [sorted(units) for units in dealt]


def balanced_rows(
    tokens: torch.Tensor, world: int, rank: int, rows_per_step: int, unit: int = 1
) -> tuple[list[int], list[int]]:
    """The rows (indices into the rank-major gathered buffer, `[world * N]`) that `rank` trains on, step by step,
    and each rank's token total per step (`[steps * world]`, step-major). `tokens`: `[world, N]` tokens of every
    rank's rows; rows `s * rows_per_step ...` of each rank belong to optimizer step `s`; `unit` rows stay together."""
    N = tokens.shape[1]
    take: list[int] = []
    totals: list[int] = []
    flat = tokens.reshape(-1)
    for start in range(0, N, rows_per_step):
        step_rows = [r * N + start + i for r in range(world) for i in range(rows_per_step)]  # global, rank-major
        unit_tokens = [int(flat[step_rows[u : u + unit]].sum()) for u in range(0, len(step_rows), unit)]
        dealt = balanced_assignment(unit_tokens, world)
        totals += [sum(unit_tokens[u] for u in units) for units in dealt]
        take += [step_rows[u * unit + i] for u in dealt[rank] for i in range(unit)]
    return take, totals


def padded_fields(batch: RolloutBatch, prompt_width: int, completion_width: int, pad_id: int) -> dict:
    """Every tensor field of `batch`, prompts widened on the left and completions on the right to the given widths
    (pad id, mask 0, log-prob 0), so that the ranks' buffers stack."""
    out = {}
    for f in fields(batch):
        value = getattr(batch, f.name)
        if value is None:
            continue
        if layout(f) == "prompt":
            value = torch.nn.functional.pad(value, (prompt_width - value.shape[1], 0), value=fill(f, pad_id))
        elif layout(f) == "completion":
            value = torch.nn.functional.pad(value, (0, completion_width - value.shape[1]), value=fill(f, pad_id))
        out[f.name] = value
    return out


def concat_batches(batches: list[RolloutBatch], pad_id: int) -> RolloutBatch:
    """Batches one after the other (row-wise), prompts and completions padded to the widest of them."""
    prompt_width = max(b.prompt_ids.shape[1] for b in batches)
    completion_width = max(b.completion_ids.shape[1] for b in batches)
    parts = [padded_fields(b, prompt_width, completion_width, pad_id) for b in batches]
    return replace(batches[0], **{name: torch.cat([part[name] for part in parts]) for name in parts[0]})


def rows_of(batch: RolloutBatch, gathered: dict, rows: list[int]) -> RolloutBatch:
    """`batch` with the `rows` of the gathered fields (`[world * N, ...]` each), prompts and completions trimmed to
    the widest real prompt and completion among them."""
    index = torch.tensor(rows, device=batch.prompt_ids.device)
    values = {name: value[index] for name, value in gathered.items()}
    prompt_width = int(values["prompt_mask"].sum(dim=1).max())
    completion_width = int(values["completion_mask"].sum(dim=1).max())
    for f in fields(batch):
        if f.name in values and layout(f) == "prompt":
            values[f.name] = values[f.name][:, values[f.name].shape[1] - prompt_width :]
        elif f.name in values and layout(f) == "completion":
            values[f.name] = values[f.name][:, :completion_width]
    return replace(batch, **values)


def exchange_rows(
    batch: RolloutBatch, rows: list[int], all_gather: Callable[[torch.Tensor], torch.Tensor], pad_id: int
) -> RolloutBatch:
    """The `rows` of every rank's buffer (rank-major indices), gathered from all ranks. Every rank calls it at the
    same point; fields that are None are None on every rank."""
    shape = [batch.prompt_ids.shape[1], batch.completion_ids.shape[1]]
    widths = all_gather(torch.tensor(shape, device=batch.prompt_ids.device))  # [world, 2]
    prompt_width, completion_width = (int(w) for w in widths.reshape(-1, 2).max(dim=0).values)
    local = padded_fields(batch, prompt_width, completion_width, pad_id)
    gathered = {name: all_gather(value).flatten(0, 1) for name, value in local.items()}  # [world * N, ...]
    return rows_of(batch, gathered, rows)
