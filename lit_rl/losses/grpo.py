"""GRPO policy loss: the clipped surrogate per token and the k3 KL term, aggregated by name.

Shapes: N sequences in the micro-batch, T completion tokens. The per-token loss is

    r_t      = exp(logprobs_t - old_logprobs_t)
    l_t      = -w_t * min(r_t * A, clip(r_t, 1 - epsilon_low, 1 + epsilon_high) * A) + beta * k3_t
    k3_t     = exp(ref_t - logprobs_t) - (ref_t - logprobs_t) - 1

with the default objective, PPO's clipped surrogate; `policy_loss` swaps in another (GSPO, GSPO-token, CISPO, or
a user's: `lit_rl.losses.policy`) for the `-min(...)` term, the rest unchanged.

w_t is 1 unless a rollout correction is asked for (`rollout_is_weights`): the importance ratio of the trainer's
probability of the sampled tokens over the engine's, which differ when the engine's numerics differ (bf16 vLLM) or
when the engine sampled with older weights (asynchronous rollouts). Truncated (Yao et al. 2025) per token or per
sequence, or masked per sequence; a constant: no gradient flows through it.

The KL term is added per token *before* aggregation, so it is normalised exactly like the policy term; the
aggregation that turns l [N, T] into the step's scalar is a named choice (`lit_rl.losses.aggregation`).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from lit_rl.losses.aggregation import LossAggregation, LossNormalizer, aggregate
from lit_rl.losses.policy import PolicyLoss, policy_loss_function
from lit_rl.ops import kl_k3


def grpo_per_token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    ref_logprobs: Optional[torch.Tensor] = None,
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    importance_weights: Optional[torch.Tensor] = None,
    policy_loss: str | PolicyLoss = "ppo_clip",
    completion_mask: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token policy objective plus `beta * k3` (see module docstring).

    logprobs, old_logprobs, ref_logprobs, importance_weights (w, default 1), completion_mask (default 1): [N, T];
    advantages: [N]. `policy_loss`: a name in `lit_rl.losses.policy.POLICY_LOSSES` (default `ppo_clip`, the
    clipped surrogate above), an import path, or the function itself. Returns the per-token loss [N, T] and
    per-token stats [N, T]: `kl` (when beta > 0), `clipped_low` (the clipping changed the gradient of a token with
    A < 0; CISPO: r < 1 - eps_low), `clipped_high` (likewise with A > 0; CISPO: r > 1 + eps_high), `ratio`.
    """
    objective = policy_loss_function(policy_loss) if isinstance(policy_loss, str) else policy_loss
    mask = torch.ones_like(logprobs) if completion_mask is None else completion_mask
    per_token, stats = objective(logprobs, old_logprobs, advantages, mask, epsilon_low, epsilon_high)
    if importance_weights is not None:
        per_token = per_token * importance_weights.detach()
    if beta != 0.0:
        if ref_logprobs is None:
            raise ValueError("beta != 0 needs ref_logprobs")
        kl = kl_k3(logprobs, ref_logprobs)
        per_token = per_token + beta * kl
        stats["kl"] = kl.detach()
    return per_token, stats


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    aggregation: LossAggregation = "sequence",
    normalizer: Optional[LossNormalizer] = None,
    ref_logprobs: Optional[torch.Tensor] = None,
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    importance_weights: Optional[torch.Tensor] = None,
    policy_loss: str | PolicyLoss = "ppo_clip",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO loss of one micro-batch: `aggregate(grpo_per_token_loss(...))`; stats as in `grpo_per_token_loss`.

    `normalizer` defaults to this micro-batch's own counts (`LossNormalizer.local`).
    """
    per_token, stats = grpo_per_token_loss(
        logprobs,
        old_logprobs,
        advantages,
        ref_logprobs,
        beta,
        epsilon_low,
        epsilon_high,
        importance_weights,
        policy_loss,
        completion_mask,
    )
    normalizer = normalizer or LossNormalizer.local(completion_mask)
    return aggregate(per_token, completion_mask, aggregation, normalizer), stats


IS_CORRECTIONS = ("none", "token_truncate", "sequence_truncate", "sequence_mask")


def rollout_is_weights(
    mode: str, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, completion_mask: torch.Tensor, cap: float
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The rollout correction's weights w [N, T] (detached, 0 on padding) and which tokens it changed [N, T] bool
    (truncated or masked), or (None, None) for `none`. With d_t = old_logprobs_t - rollout_logprobs_t (the
    trainer's log-prob of the sampled token minus the engine's) and C = cap:

        token_truncate    : w_t = min(exp(d_t), C)                                    (TIS, per token)
        sequence_truncate : w_t = min(rho_i, C),  rho_i = exp(sum_t m_it d_it)        (per sequence, every token)
        sequence_mask     : w_t = rho_i if 1/C <= rho_i <= C else 0                    (MIS: the sequence is dropped)

    Sequence ratios multiply the token ratios, so they move away from 1 as completions grow: a cap of 2 masks far
    more of long completions than of short ones.
    """
    if mode == "none":
        return None, None
    tokens = completion_mask > 0
    log_ratio = ((old_logprobs - rollout_logprobs).detach() * completion_mask).nan_to_num(0.0)  # [N, T]
    log_cap = math.log(cap)
    if mode == "token_truncate":
        changed = (log_ratio > log_cap) & tokens
        return torch.exp(log_ratio.clamp(max=log_cap)) * completion_mask, changed
    sequence_log_ratio = log_ratio.sum(dim=1, keepdim=True)  # [N, 1]
    if mode == "sequence_truncate":
        changed = (sequence_log_ratio > log_cap) & tokens
        return torch.exp(sequence_log_ratio.clamp(max=log_cap)) * completion_mask, changed
    if mode == "sequence_mask":
        outside = sequence_log_ratio.abs() > log_cap  # [N, 1]
        weights = torch.exp(sequence_log_ratio).masked_fill(outside, 0.0) * completion_mask
        return weights, outside & tokens
    raise ValueError(f"unknown rollout correction {mode!r}; expected one of {IS_CORRECTIONS}")
