"""Group-relative advantages (GRPO, Dr. GRPO)."""

from __future__ import annotations

from typing import Literal

import torch

ScaleRewards = Literal["group", "batch", "none"]


def group_advantages(
    rewards: torch.Tensor, group_size: int, scale_rewards: ScaleRewards = "group", eps: float = 1e-4
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Advantages of completions sampled in groups of `group_size` consecutive rows.

    `rewards` [B*G] (all completions of whole groups, gathered across ranks first) ->
    `advantages` [B*G], `stats` with per-row `group_std` [B*G] and `group_mean` [B*G].

        A_i = r_i - mean(group(i))                           scale_rewards = "none"  (Dr. GRPO)
        A_i = (r_i - mean(group(i))) / (std(group(i)) + eps)  scale_rewards = "group" (GRPO paper)
        A_i = (r_i - mean(group(i))) / (std(all r) + eps)     scale_rewards = "batch"

    `std` is the unbiased (n - 1) standard deviation, as in the GRPO reference implementations.
    """
    if rewards.ndim != 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards must be 1-D with a multiple of group_size={group_size} rows, got {tuple(rewards.shape)}"
        )
    grouped = rewards.view(-1, group_size)  # [B, G]
    group_mean = grouped.mean(dim=1, keepdim=True).expand_as(grouped).reshape(-1)
    group_std = grouped.std(dim=1, keepdim=True).expand_as(grouped).reshape(-1)
    centered = rewards - group_mean
    if scale_rewards == "group":
        advantages = centered / (group_std + eps)
    elif scale_rewards == "batch":
        advantages = centered / (rewards.std() + eps)
    elif scale_rewards == "none":
        advantages = centered
    else:
        raise ValueError(f"scale_rewards must be one of 'group', 'batch', 'none', got {scale_rewards!r}")
    return advantages, {"group_std": group_std, "group_mean": group_mean}
