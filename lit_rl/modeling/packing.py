"""Padding-free (packed) forward passes: the rows' real tokens laid end to end, no pad token computed.

A padded batch runs `[prompt, completion]` rows of `P + T` tokens, left-padded prompts and right-padded
completions included; with completions of very different lengths most of that is padding. Here each row's real
tokens, `prompt[prompt_mask]` followed by its first `c_i = completion_mask[i].sum()` completion tokens, become one
sequence, and the sequences are laid end to end into packed rows. Position ids restart at 0 with each sequence,
which `transformers` reads as packed input (with `attention_mask=None` and no cache): sdpa and eager attention get
a block-diagonal causal mask, flash attention its varlen kernel (`cu_seq_lens` from the restarts). A sequence sees
exactly the tokens and positions it sees in the padded forward, so the logits agree to float rounding (a test checks
logits and gradients against the padded and the shared-prompt forwards).

How sequences are cut into packed rows:
- flash attention (`config._attn_implementation` starting with `flash`): one row; the kernel costs
  sum_i L_i^2, whatever the row length. transformers reads varlen packing from a single row only.
- any other attention (sdpa, eager: the CPU paths): rows filled first-fit in decreasing length, of a width W of
  1, 1.25, 1.5 or 2 times the longest sequence, whichever computes the fewest positions (rows x W; the first on
  ties). The dense block-diagonal mask costs W^2 per row, so attention per position stays within 2x the padded
  forward's, while wider rows leave less filler at their ends (`benchmarks/packing.py` times the result).
Trailing room in a row is filled with a dummy sequence (token 0, its own positions): causal attention keeps every
real token from seeing it, and its logits are dropped.

Only the logits that predict completion tokens are computed (`logits_to_keep` as indices) and scattered back to
`[N, T, V]`, zero where `completion_mask` is 0, so every consumer of the padded logits works unchanged.

Completion masks must be prefixes (1s, then 0s: the engines stop at EOS); a mask with holes is refused.
Pure torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from lit_rl.training.compat import attention_implementation


@dataclass
class PackedBatch:
    """Rows of sequences laid end to end, and where each completion-predicting logit goes.

    `logit_rows`, `logit_columns`: the packed position [K] of each kept logit (the logit at a sequence's position
    `p_i - 1 + t` predicts its completion token t); `target_rows`, `target_columns`: the `[N, T]` slot [K] it
    fills. `dummy_tokens`: the filler at the rows' ends.
    """

    input_ids: torch.Tensor  # [R, W]
    position_ids: torch.Tensor  # [R, W]
    logit_rows: torch.Tensor  # [K]
    logit_columns: torch.Tensor  # [K]
    target_rows: torch.Tensor  # [K]
    target_columns: torch.Tensor  # [K]
    dummy_tokens: int


def real_token_lengths(mask: torch.Tensor, left_padded: bool, what: str) -> torch.Tensor:
    """The real tokens of each row [N] of a mask [N, L] that must be left-padded (0s, then 1s) or a prefix (1s,
    then 0s); fails naming the first row that is not."""
    lengths = mask.sum(dim=1).long()  # [N]
    columns = torch.arange(mask.shape[1], device=mask.device)
    expected = columns >= mask.shape[1] - lengths[:, None] if left_padded else columns < lengths[:, None]
    if not torch.equal(expected, mask.bool()):
        row = int((expected != mask.bool()).any(dim=1).nonzero()[0])
        shape = "0s then 1s (left padding)" if left_padded else "1s then 0s"
        raise ValueError(f"padding-free forward: the {what} of row {row} is not {shape}")
    return lengths


def first_fit_decreasing(sizes: list[int], capacity: int, max_bins: Optional[int] = None) -> list[list[int]]:
    """Item indices per bin, first-fit in decreasing size into bins of at most `capacity` (an item larger than that
    gets a bin of its own). With `max_bins`, once that many are open an item that fits nowhere joins the bin with
    the least in it (over capacity). Deterministic: ties keep the items' order; a bin lists its items as placed.
    Packed rows and token-budget micro-batches (`lit_rl.training.micro_batches`) are both cut this way."""
    bins: list[list[int]] = []
    used: list[int] = []
    for item in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        size = sizes[item]
        target = next((b for b, total in enumerate(used) if total + size <= capacity), None)
        if target is None:
            if max_bins is None or len(bins) < max_bins:
                bins.append([])
                used.append(0)
                target = len(bins) - 1
            else:
                target = min(range(len(used)), key=lambda b: used[b])
        bins[target].append(item)
        used[target] += size
    return bins


def assign_rows(lengths: list[int], capacity: Optional[int]) -> list[list[int]]:
    """Sequence indices per packed row: one row when `capacity` is None, else `first_fit_decreasing` into rows of
    at most `capacity` tokens."""
    if capacity is None:
        return [list(range(len(lengths)))]
    return first_fit_decreasing(lengths, capacity)


ROW_WIDTH_FACTORS = (1.0, 1.25, 1.5, 2.0)


def packed_layout(sizes: list[int], single_row: bool) -> list[list[int]]:
    """Sequence indices per packed row (module docstring): one row, or the candidate width computing the fewest
    positions."""
    if single_row:
        return assign_rows(sizes, None)
    best: Optional[list[list[int]]] = None
    best_positions = None
    for factor in ROW_WIDTH_FACTORS:
        layout = assign_rows(sizes, int(max(sizes) * factor))
        positions = len(layout) * max(sum(sizes[i] for i in row) for row in layout)
        if best_positions is None or positions < best_positions:
            best, best_positions = layout, positions
    return best


def pack_completions(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    single_row: bool = False,
) -> PackedBatch:
    """Pack `[N, P]` left-padded prompts and `[N, T]` completions (module docstring). `single_row`: all sequences
    in one row (flash attention), else `packed_layout`'s rows."""
    device = prompt_ids.device
    p = real_token_lengths(prompt_mask, left_padded=True, what="prompt_mask")  # [N]
    c = real_token_lengths(completion_mask, left_padded=False, what="completion_mask")  # [N]
    if (p == 0).any():  # the first completion token would have no position to be predicted from
        raise ValueError(f"padding-free forward: row {int((p == 0).nonzero()[0])} has an empty prompt")
    sizes = p + c  # [N] tokens of each sequence
    size_list = sizes.tolist()
    layout = packed_layout(size_list, single_row)
    width = max(sum(size_list[i] for i in row) for row in layout)
    # Where each sequence starts in the flattened [R * W] rows.
    starts = [0] * len(size_list)
    for r, row in enumerate(layout):
        offset = r * width
        for i in row:
            starts[i] = offset
            offset += size_list[i]
    start = torch.tensor(starts, dtype=torch.long, device=device)  # [N]
    # The real tokens of row i are contiguous in [prompt, completion]: columns P - p_i .. P + c_i - 1.
    tokens = torch.cat([prompt_ids, completion_ids], dim=1)[
        torch.cat([prompt_mask, completion_mask.to(prompt_mask.dtype)], dim=1).bool()
    ]  # [sum sizes], sequence after sequence
    within = torch.arange(len(tokens), device=device) - (sizes.cumsum(0) - sizes).repeat_interleave(sizes)
    destination = start.repeat_interleave(sizes) + within
    input_ids = torch.zeros(len(layout) * width, dtype=prompt_ids.dtype, device=device)
    input_ids[destination] = tokens
    # Positions restart with every sequence; the filler after a row's last sequence counts as one more sequence.
    position_ids = torch.zeros(len(layout) * width, dtype=torch.long, device=device)
    position_ids[destination] = within
    for r, row in enumerate(layout):
        end = r * width + sum(size_list[i] for i in row)
        position_ids[end : (r + 1) * width] = torch.arange((r + 1) * width - end, device=device)
    # Kept logits: sequence i's position p_i - 1 + t predicts its completion token t, t < c_i.
    t = torch.arange(int(c.sum()), device=device) - (c.cumsum(0) - c).repeat_interleave(c)  # [K]
    flat = (start + p - 1).repeat_interleave(c) + t  # [K] in the flattened rows
    return PackedBatch(
        input_ids.view(len(layout), width),
        position_ids.view(len(layout), width),
        logit_rows=flat // width,
        logit_columns=flat % width,
        target_rows=torch.arange(len(c), device=device).repeat_interleave(c),
        target_columns=t,
        dummy_tokens=len(layout) * width - len(tokens),
    )


def uses_flash_attention(model: torch.nn.Module) -> bool:
    """Whether the model attends with a flash-attention kernel (varlen packing in one row)."""
    return attention_implementation(model).startswith("flash")


def packed_completion_forward(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
) -> torch.Tensor:
    """Logits that predict each completion token, [N, P] + [N, T] -> [N, T, V], from one packed forward (zero
    where `completion_mask` is 0). Exactly one forward per call, so ranks with sharded parameters stay in step."""
    packed = pack_completions(
        prompt_ids, prompt_mask, completion_ids, completion_mask, single_row=uses_flash_attention(model)
    )
    # Only the columns holding a kept logit go through the head: [R, C, V] for the C distinct columns.
    columns, column_of = torch.unique(packed.logit_columns, return_inverse=True)
    out = model(
        input_ids=packed.input_ids,
        position_ids=packed.position_ids,
        attention_mask=None,  # packed: transformers builds the per-sequence causal mask from the position restarts
        use_cache=False,  # a cache would make transformers skip the packed-sequence detection
        logits_to_keep=columns,
    )
    kept = out.logits[packed.logit_rows, column_of]  # [K, V]
    N, T = completion_ids.shape
    logits = kept.new_zeros(N, T, kept.shape[-1])
    return logits.index_put((packed.target_rows, packed.target_columns), kept)  # [N, T, V]


def packed_completion_hidden(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The decoder's last hidden states [K, H] at the K positions that predict completion tokens (`lit_rl.modeling.head`
    takes them through the output head), with the (row, column) [K] of each predicted token, row by row."""
    packed = pack_completions(
        prompt_ids, prompt_mask, completion_ids, completion_mask, single_row=uses_flash_attention(model)
    )
    out = model.get_decoder()(
        input_ids=packed.input_ids, position_ids=packed.position_ids, attention_mask=None, use_cache=False
    )
    hidden = out.last_hidden_state[packed.logit_rows, packed.logit_columns]  # [K, H]
    return hidden, packed.target_rows, packed.target_columns
