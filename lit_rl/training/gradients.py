"""Gradient clipping by the global L2 norm that leaves the gradients alone when they are already within the cap."""

from __future__ import annotations

from typing import Iterable

import torch


def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float) -> None:
    """Scale the gradients of `params` in place so that their global L2 norm is at most `max_norm`, exactly as
    `torch.nn.utils.clip_grad_norm_` does:

        g <- g * min(1, max_norm / (||g||_2 + 1e-6)),   ||g||_2 taken over every gradient together,

    except that the multiply is skipped when that factor is 1. torch multiplies by the clamped factor regardless,
    to spare a host-device sync; a skipped multiply gives the same bits (x * 1.0 == x) and saves a read and a write
    of every gradient on the steps that need no clipping. The sync costs a scalar per optimizer step on a GPU."""
    params = [p for p in params if p.grad is not None]
    if not params:
        return
    total = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)  # clip_grad_norm_'s own (torch >= 2.6)
    if max_norm / (total + 1e-6) < 1:  # torch's clip coefficient, before its clamp at 1
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
