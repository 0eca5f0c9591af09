"""DAPO's overlong handling (Yu et al. 2025): a reward penalty near the length limit, and which completions were
cut off by it.

Soft overlong punishment, for a completion of L tokens, the limit L_max = `max_new_tokens` and a buffer of B tokens:

    penalty(L) = 0                                  L <= L_max - B
                 c * (L - (L_max - B)) / B          L_max - B < L <= L_max      (c = `overlong_penalty`, up to c)

subtracted from the reward before advantages, so answers that run into the limit learn to be shorter. Overlong
filtering gives truncated completions (no EOS within L_max) no loss at all. Pure torch.
"""

from __future__ import annotations

from typing import Sequence

import torch


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer: int, scale: float = 1.0) -> torch.Tensor:
    """penalty(L) [N] of completion lengths [N] (module docstring); zeros when `buffer` is 0."""
    if buffer <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    over = (lengths.float() - (max_new_tokens - buffer)).clamp(min=0.0, max=float(buffer))
    return scale * over / buffer


def truncated(
    completion_ids: torch.Tensor, completion_mask: torch.Tensor, eos_token_ids: Sequence[int]
) -> torch.Tensor:
    """[N] bool: the completions whose last token in `completion_mask` is not an EOS (cut off by the length limit).
    For a multi-turn transcript, pass the model's tokens (`sampled_mask`): each earlier turn ended with an EOS, and
    only the last one says whether the episode was cut off."""
    eos = torch.tensor(list(eos_token_ids), device=completion_ids.device)
    mask = completion_mask > 0
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, -1).max(dim=1).values  # [N], -1 for no token
    last_ids = completion_ids.gather(1, last.clamp(min=0)[:, None])[:, 0]
    return ~(torch.isin(last_ids, eos) & (last >= 0))
