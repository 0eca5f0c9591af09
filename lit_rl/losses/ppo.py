"""PPO with a learned critic (Schulman et al. 2017; for language models Ouyang et al. 2022): per-token rewards,
generalised advantage estimation and the clipped value loss. Pure torch.

A completion of T tokens (mask m_t = 1 on its real tokens, the last of which is t = L - 1) is an episode whose
state before token t is the prompt and tokens < t. The critic's value V_t = V(s_t) is read at the position that
predicts token t. Rewards per token:

    r_t = -beta * (logp_t - ref_logp_t)            the KL penalty to the reference (beta > 0)
          + R * [t == L - 1]                       the sequence's reward, at its last token

GAE (Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage Estimation"), with
V_L = 0 after the last token:

    delta_t = r_t + gamma * V_{t+1} - V_t
    A_t     = delta_t + gamma * lambda * A_{t+1}          (A_L = 0)
    G_t     = A_t + V_t                                   (the critic's regression target, the "return")

A multi-turn transcript (`model.env.environment`) is scored on the model's tokens alone: its mask is 0 on the
environment's tokens between turns, which are not actions but part of the environment's transition. Both
functions then read the masked-out tokens as absent, as if the model's tokens were laid end to end: the sequence
reward lands on the last model token, V_{t+1} is the value at the next model token, and A carries across an
observation. On a contiguous mask (one turn) this is the recursion above, token for token.

The advantages are then whitened over all real tokens of the generation (mean 0, std 1; the statistics are the
caller's, summed over ranks). The critic's loss, clipped around the values at sampling time V_old as in the
reference implementations (OpenAI baselines, TRL, OpenRLHF):

    V_clip_t = V_old_t + clip(V_t - V_old_t, -eps_v, eps_v)
    l_t      = 0.5 * max((V_t - G_t)^2, (V_clip_t - G_t)^2)
"""

from __future__ import annotations

from typing import Optional

import torch


def token_rewards(
    rewards: torch.Tensor,
    completion_mask: torch.Tensor,
    kl: Optional[torch.Tensor] = None,
    beta: float = 0.0,
) -> torch.Tensor:
    """Per-token rewards r [N, T] (module docstring): the sequence reward `rewards` [N] at each completion's last
    real token, minus `beta * kl` [N, T] (per-token `logp - ref_logp`) where the mask is 1."""
    mask = completion_mask.to(rewards.dtype)
    last = mask.shape[1] - 1 - (mask > 0).flip(dims=[1]).int().argmax(dim=1)  # [N]: the last real token (any, if none)
    out = torch.zeros_like(mask)
    out[torch.arange(len(rewards), device=mask.device), last] = rewards * (mask.sum(dim=1) > 0).to(rewards.dtype)
    if kl is not None and beta != 0.0:
        out = out - beta * kl * mask
    return out


def gae(
    rewards: torch.Tensor, values: torch.Tensor, completion_mask: torch.Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages A [N, T] and returns G = A + V [N, T] from per-token `rewards` and `values` [N, T] (module
    docstring); zero where the mask is 0, and the value after a completion's last token is 0. Masked-out tokens
    inside a completion (a transcript's observations) are skipped: the recursion runs over the real tokens alone."""
    mask = completion_mask.float()
    values, rewards = values.float() * mask, rewards.float()  # accumulated in float32 whatever the model's dtype
    advantages = torch.zeros_like(values)
    running = torch.zeros_like(values[:, 0])  # A at the next real token (0 after the last)
    next_value = torch.zeros_like(running)  # V at the next real token (0 after the last)
    for t in reversed(range(rewards.shape[1])):
        real = mask[:, t] > 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = torch.where(real, delta + gamma * lam * running, running)
        next_value = torch.where(real, values[:, t], next_value)
        advantages[:, t] = running * mask[:, t]
    return advantages, (advantages + values) * mask


def whiten(
    advantages: torch.Tensor, completion_mask: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, eps: float = 1e-8
) -> torch.Tensor:
    """(A - mean) / (std + eps) on the real tokens, 0 elsewhere; `mean` and `std` are the generation's, over every real
    token on every rank (`masked_moments` summed over ranks)."""
    return (advantages - mean) / (std + eps) * completion_mask


def masked_moments(values: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """[count, sum, sum of squares] of the real tokens' values, in float64 (E[x^2] - mean^2 cancels when the mean is
    large against the std): summed over ranks, they give the generation's mean and std (`moments_to_mean_std`)."""
    values, mask = values.double(), completion_mask.double()
    return torch.stack([mask.sum(), (values * mask).sum(), (values * values * mask).sum()])


def moments_to_mean_std(moments: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and population std (divided by the count, not count - 1) from `masked_moments`, as float32."""
    count = moments[0].clamp(min=1.0)
    mean = moments[1] / count
    variance = (moments[2] / count - mean * mean).clamp(min=0.0)
    return mean.float(), variance.sqrt().float()


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    clip: Optional[float] = 0.2,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token critic loss l [N, T] (module docstring) and `clipped` [N, T]: tokens where the clipped error was
    the larger one (the clipping took the gradient away). `clip=None`: the plain 0.5 (V - G)^2."""
    error = (values - returns) ** 2
    if clip is None:
        return 0.5 * error, {"clipped": torch.zeros_like(error)}
    clipped_values = old_values + torch.clamp(values - old_values, -clip, clip)
    clipped_error = (clipped_values - returns) ** 2
    return 0.5 * torch.max(error, clipped_error), {"clipped": (clipped_error > error).float()}
