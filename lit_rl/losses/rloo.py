"""RLOO (Ahmadian et al. 2024, "Back to Basics"): REINFORCE with a leave-one-out baseline.

k completions per prompt, consecutive rows. With rewards r (KL-penalised, see `kl_penalized_rewards`):

    b_i = (sum_{j in group(i)} r_j - r_i) / (k - 1)          leave-one-out baseline
    A_i = r_i - b_i                                           optionally (A - mean(A)) / (std(A) + eps) over the batch

Policy loss with a sequence-level importance ratio and PPO clipping:

    rho_i = exp(sum_t m_it (logprobs_it - old_logprobs_it))
    L     = sum_i w_i * -min(rho_i A_i, clip(rho_i, 1 - epsilon, 1 + epsilon_high) A_i) / num_sequences

(`epsilon_high` defaults to `epsilon`: a symmetric clip.) w_i is the rollout correction's weight of sequence i
(detached; 1 without one): `lit_rl.losses.rollout_is_weights`'s sequence modes, whose ratio is the trainer's
probability of the sequence at sampling time over the engine's.
"""

from __future__ import annotations

from typing import Optional

import torch


def kl_penalized_rewards(
    rewards: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    completion_mask: torch.Tensor,
    beta: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`r_i - beta * sum_t m_it (logprobs_it - ref_logprobs_it)` [N] (no gradient) and the per-sequence KL [N]."""
    kl = ((logprobs - ref_logprobs) * completion_mask).sum(dim=1).detach()
    return rewards - beta * kl, kl


def rloo_advantages(rewards: torch.Tensor, group_size: int, normalize: bool = False, eps: float = 1e-8) -> torch.Tensor:
    """Leave-one-out advantages [N] of rewards [N] in groups of `group_size` consecutive rows (see module)."""
    if group_size < 2:
        raise ValueError("RLOO needs at least 2 completions per prompt")
    if rewards.ndim != 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards must be 1-D with a multiple of group_size={group_size} rows, got {tuple(rewards.shape)}"
        )
    grouped = rewards.view(-1, group_size)  # [B, k]
    baseline = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    advantages = (grouped - baseline).reshape(-1)
    if normalize:
        advantages = (advantages - advantages.mean()) / (advantages.std() + eps)
    return advantages


def rloo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    epsilon: float = 0.2,
    num_sequences: Optional[float] = None,
    epsilon_high: Optional[float] = None,
    sequence_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped sequence-level surrogate (see module), summed over these N sequences / `num_sequences`
    (default N); the ratio is clipped to `[1 - epsilon, 1 + epsilon_high]` (`epsilon_high` None: `epsilon`);
    `sequence_weights` [N]: the rollout correction's w_i (None: 1).
    Stats per sequence [N]: `ratio`, `clipped` (1 where the clipped term was the minimum)."""
    # Clamped so that exp() stays finite: inf * 0 (a zero advantage) would be NaN.
    log_ratio = ((logprobs - old_logprobs) * completion_mask).sum(dim=1).clamp(-20.0, 20.0)  # [N]
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    high = epsilon if epsilon_high is None else epsilon_high
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + high) * advantages
    losses = -torch.min(unclipped, clipped)
    if sequence_weights is not None:
        losses = losses * sequence_weights.detach()
    stats = {"ratio": ratio.detach(), "clipped": (clipped < unclipped).float()}
    return losses.sum() / (num_sequences if num_sequences is not None else losses.shape[0]), stats
