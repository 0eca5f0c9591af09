"""Advantage estimators of GRPO-style training, chosen by name (`--model.loss.advantage`).

Every estimator has the signature of `AdvantageEstimator`: the rewards of every completion of the generation
across ranks, [B*G] in groups of `group_size` consecutive rows, the group size and `scale_rewards` in; advantages
[B*G] and stats out. With r the rewards, mean_g / std_g over i's group and mean / std over all B*G:

    group                 : group_advantages below (GRPO; `scale_rewards` group / batch / none: Dr. GRPO)
    rloo                  : A_i = r_i - mean_{j in group(i), j != i} r_j = G/(G-1) (r_i - mean_g)   (RLOO)
    reinforce_pp          : A_i = (r_i - mean) / (std + eps)            (REINFORCE++, global batch normalisation)
    reinforce_pp_baseline : c_i = r_i - mean_g;  A_i = c_i / (std(c) + eps)     (REINFORCE++-baseline; mean(c) = 0)

`rloo` and the REINFORCE++ forms do not read `scale_rewards`. REINFORCE++ puts its KL penalty in the reward; here
the KL stays GRPO's `beta * k3` loss term, the same for every estimator. A user's own estimator with this
signature is given by import path. Pure torch.
"""

from __future__ import annotations

from typing import Any, Callable, Literal, Optional, get_args

import torch

from lit_rl.losses.resolve import resolve_function, tensor_pair_problem
from lit_rl.losses.rloo import rloo_advantages

ScaleRewards = Literal["group", "batch", "none"]
SCALE_REWARDS: tuple[str, ...] = get_args(ScaleRewards)
STD_EPS = 1e-4  # added to a standard deviation before dividing by it
AdvantageEstimator = Callable[[torch.Tensor, int, str], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def group_advantages(
    rewards: torch.Tensor, group_size: int, scale_rewards: ScaleRewards = "group", eps: float = STD_EPS
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Advantages of completions sampled in groups of `group_size` consecutive rows.

    `rewards` [B*G] (all completions of whole groups, gathered across ranks first) ->
    `advantages` [B*G], `stats` with per-row `group_std` [B*G] and `group_mean` [B*G].

        A_i = r_i - mean(group(i))                           scale_rewards = "none"  (Dr. GRPO)
        A_i = (r_i - mean(group(i))) / (std(group(i)) + eps)  scale_rewards = "group" (GRPO paper)
        A_i = (r_i - mean(group(i))) / (std(all r) + eps)     scale_rewards = "batch"

    `std` is the unbiased (n - 1) standard deviation, as in the GRPO reference implementations.
    """
    grouped = _grouped(rewards, group_size)  # [B, G]
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
        raise ValueError(f"scale_rewards must be one of {list(SCALE_REWARDS)}, got {scale_rewards!r}")
    return advantages, {"group_std": group_std, "group_mean": group_mean}


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.ndim != 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards must be 1-D with a multiple of group_size={group_size} rows, got {tuple(rewards.shape)}"
        )
    return rewards.view(-1, group_size)  # [B, G]


def loo_advantages(
    rewards: torch.Tensor, group_size: int, scale_rewards: str = "none"
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Leave-one-out baseline (`lit_rl.losses.rloo.rloo_advantages`, unnormalised): A_i = r_i - (sum of i's group
    - r_i) / (G - 1). [B*G] -> [B*G]."""
    return rloo_advantages(rewards, group_size), {}


def reinforce_pp_advantages(
    rewards: torch.Tensor, group_size: int, scale_rewards: str = "none", eps: float = STD_EPS
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """REINFORCE++: A_i = (r_i - mean(all r)) / (std(all r) + eps), unbiased std. [B*G] -> [B*G]."""
    _grouped(rewards, group_size)
    return (rewards - rewards.mean()) / (rewards.std() + eps), {}


def reinforce_pp_baseline_advantages(
    rewards: torch.Tensor, group_size: int, scale_rewards: str = "none", eps: float = STD_EPS
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """REINFORCE++-baseline: c_i = r_i - mean(group(i)), then A_i = c_i / (std(all c) + eps). [B*G] -> [B*G]."""
    grouped = _grouped(rewards, group_size)
    centered = (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)
    return centered / (centered.std() + eps), {}


ADVANTAGES: dict[str, AdvantageEstimator] = {
    "group": group_advantages,
    "rloo": loo_advantages,
    "reinforce_pp": reinforce_pp_advantages,
    "reinforce_pp_baseline": reinforce_pp_baseline_advantages,
}


def advantage_function(name: str) -> AdvantageEstimator:
    """The estimator named `name` (a key of `ADVANTAGES`) or at the import path `name`."""
    return resolve_function("model.loss.advantage", name, ADVANTAGES, _one_per_reward)


def _one_per_reward(args: tuple, result: Any) -> Optional[str]:
    """What is wrong with a user's estimator's `(advantages, stats)` for `args[0]`, the rewards [N]; None if
    nothing."""
    rewards = args[0]
    wrong = tensor_pair_problem(result, "advantages")
    if wrong is not None:
        return wrong
    if result[0].shape[:1] != rewards.shape[:1]:
        return f"returned {tuple(result[0].shape)} advantages for {rewards.shape[0]} rewards (one per completion)"
    return None
