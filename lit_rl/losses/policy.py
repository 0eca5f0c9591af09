"""Policy objectives of GRPO-style training, per token, chosen by name (`--model.loss.objective`).

Every objective has the signature of `PolicyLoss`: the micro-batch's log-probs, the log-probs of the policy that
sampled (`old_logprobs`), the advantages and the completion mask in; the per-token loss l [N, T] and per-token
stats out: `ratio` (the importance ratio the objective uses), `clipped_low` and `clipped_high` (tokens whose
gradient the clipping changed). `lit_rl.losses.grpo` then adds `beta * k3` per token, weighs by the rollout
correction, and aggregates with the step's denominators, the same for every objective. With r_t = exp(logprobs_t -
old_logprobs_t), A the sequence's advantage and eps_low / eps_high the clipping range:

    ppo_clip   : l_t = -min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A)                    (PPO, GRPO, DAPO)
    gspo       : s_i = exp(sum_t m_t (logprobs_t - old_t) / sum_t m_t)    (the length-normalised sequence ratio)
                 l_t = -min(s_i A, clip(s_i, 1 - eps_low, 1 + eps_high) A) on every token of sequence i
                                                                            (GSPO, Zheng et al. 2025)
    gspo_token : s_it = sg(s_i) * exp(logprobs_t - sg(logprobs_t)): the value of s_i, each token's own gradient;
                 l_t = -min(s_it A, clip(s_it, 1 - eps_low, 1 + eps_high) A)
                 (GSPO-token: with one advantage per sequence its gradient equals GSPO's)
    cispo      : l_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A logprobs_t
                 (CISPO, MiniMax-M1 2025: the clipped ratio is a constant weight, so no token leaves the gradient)

sg is stop-gradient. GSPO and GSPO-token are sequence objectives: the `sequence` aggregation (mean over each
sequence's tokens, then over sequences) gives the paper's 1/G sum_i. The GSPO paper clips far tighter than PPO
(eps 3e-4 / 4e-4); CISPO's paper clips only from above (a large eps_low). At r = 1, ppo_clip and the GSPO forms
have value -A per token (a zero loss over group-normalised advantages), CISPO -A logprobs_t.

A user's own objective with this signature is given by import path (`my_pkg.losses.my_objective` or
`my_pkg.losses:my_objective`) and runs exactly like these. Pure torch.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from lit_rl.losses.resolve import resolve_function, tensor_pair_problem

PolicyLoss = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, float],
    tuple[torch.Tensor, dict[str, torch.Tensor]],
]


def _clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, epsilon_low: float, epsilon_high: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """-min(ratio A, clip(ratio) A) [N, T] for ratio [N, T] (or [N, 1]) and advantages [N] (or per token, [N, T])."""
    adv = _per_token(advantages)
    clipped = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high) * adv
    per_token = -torch.min(ratio * adv, clipped)
    stats = {
        "ratio": ratio.detach(),
        "clipped_low": ((ratio < 1.0 - epsilon_low) & (adv < 0)).float(),
        "clipped_high": ((ratio > 1.0 + epsilon_high) & (adv > 0)).float(),
    }
    return per_token, stats


def _per_token(advantages: torch.Tensor) -> torch.Tensor:
    """Advantages as [N, 1] (one per sequence, [N]) or [N, T] (one per token: PPO's GAE) to broadcast over tokens."""
    return advantages.unsqueeze(1) if advantages.dim() == 1 else advantages


def ppo_clip(logprobs, old_logprobs, advantages, completion_mask, epsilon_low=0.2, epsilon_high=0.2):
    """PPO's clipped surrogate per token (module docstring). [N, T] in, loss [N, T] and stats [N, T] out."""
    return _clipped_surrogate(torch.exp(logprobs - old_logprobs), advantages, epsilon_low, epsilon_high)


def _sequence_log_ratio(logprobs, old_logprobs, completion_mask) -> torch.Tensor:
    """log s_i [N, 1]: the mean over the sequence's tokens of logprobs - old_logprobs."""
    diff = (logprobs - old_logprobs) * completion_mask
    return diff.sum(dim=1, keepdim=True) / completion_mask.sum(dim=1, keepdim=True).clamp(min=1)


def gspo(logprobs, old_logprobs, advantages, completion_mask, epsilon_low=3e-4, epsilon_high=4e-4):
    """GSPO: the clipped surrogate of the length-normalised sequence ratio, on every token (module docstring)."""
    ratio = torch.exp(_sequence_log_ratio(logprobs, old_logprobs, completion_mask))  # [N, 1]
    per_token, stats = _clipped_surrogate(ratio, advantages, epsilon_low, epsilon_high)
    shape = logprobs.shape
    return per_token.expand(shape), {name: value.expand(shape) for name, value in stats.items()}


def gspo_token(logprobs, old_logprobs, advantages, completion_mask, epsilon_low=3e-4, epsilon_high=4e-4):
    """GSPO-token: the sequence ratio's value with each token's own gradient (module docstring)."""
    log_s = _sequence_log_ratio(logprobs, old_logprobs, completion_mask).detach()  # [N, 1]
    ratio = torch.exp(log_s + logprobs - logprobs.detach())  # [N, T]; value s_i, d/dlogprobs_t = s_i
    return _clipped_surrogate(ratio, advantages, epsilon_low, epsilon_high)


def cispo(logprobs, old_logprobs, advantages, completion_mask, epsilon_low=0.2, epsilon_high=0.2):
    """CISPO: REINFORCE weighted by the clipped, stop-gradient importance ratio (module docstring)."""
    ratio = torch.exp(logprobs - old_logprobs).detach()  # [N, T]
    weight = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    adv = _per_token(advantages)
    per_token = -weight * adv * logprobs
    stats = {
        "ratio": ratio,
        "clipped_low": (ratio < 1.0 - epsilon_low).float(),
        "clipped_high": (ratio > 1.0 + epsilon_high).float(),
    }
    return per_token, stats


POLICY_LOSSES: dict[str, PolicyLoss] = {
    "ppo_clip": ppo_clip,
    "gspo": gspo,
    "gspo_token": gspo_token,
    "cispo": cispo,
}


def policy_loss_function(name: str) -> PolicyLoss:
    """The objective named `name` (a key of `POLICY_LOSSES`) or at the import path `name`."""
    return resolve_function("model.loss.objective", name, POLICY_LOSSES, _per_token_pair)


def _per_token_pair(args: tuple, result: Any) -> Optional[str]:
    """What is wrong with a user's objective's `(per_token_loss, stats)` for `args[0]`, the log-probs [N, T]; None
    if nothing."""
    wrong = tensor_pair_problem(result, "per-token loss")
    if wrong is not None:
        return wrong
    if result[0].shape != args[0].shape:
        return f"returned a loss of shape {tuple(result[0].shape)} for log-probs of {tuple(args[0].shape)} (per token)"
    return None
