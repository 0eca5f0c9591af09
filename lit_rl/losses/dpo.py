"""DPO-family losses on sequence log-probs (Rafailov et al. 2023 and variants).

Inputs are per-pair sequence log-probs, summed over completion tokens: `chosen_logps`, `rejected_logps` [B] of the
policy and `ref_chosen_logps`, `ref_rejected_logps` [B] of the reference. With

    h = (chosen_logps - rejected_logps) - (ref_chosen_logps - ref_rejected_logps)      # [B]

the losses (mean over the pairs given; callers pass `num_pairs` to normalise over a larger batch) are

    sigmoid : -(1 - eps) log s(beta h) - eps log s(-beta h)              (DPO; cDPO label smoothing eps)
    robust  : (-(1 - eps) log s(beta h) + eps log s(-beta h)) / (1 - 2 eps)   (Chowdhury et al. 2024)
    hinge   : max(0, 1 - beta h)                                          (SLiC)
    ipo     : (h - 1 / (2 beta))^2                                        (Azar et al. 2023; pass length-averaged
                                                                            log-probs, as the IPO paper does)
    apo_zero: 1 - s(beta (chosen - ref_chosen)) + s(beta (rejected - ref_rejected))   (D'Oosterlinck et al. 2024)
    simpo   : -(1 - eps) log s(m) - eps log s(-m),  m = beta (chosen / |y_c| - rejected / |y_r|) - gamma
              (Meng et al. 2024; reference-free, length-normalised)

s is the logistic sigmoid. Implicit rewards: `beta * (logps - ref_logps)` (SimPO: `beta * logps / length`).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

DPO_LOSSES = ("sigmoid", "robust", "hinge", "ipo", "apo_zero", "simpo")
REFERENCE_FREE = ("simpo",)


def dpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: Optional[torch.Tensor],
    ref_rejected_logps: Optional[torch.Tensor],
    loss_type: str = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    chosen_lengths: Optional[torch.Tensor] = None,
    rejected_lengths: Optional[torch.Tensor] = None,
    simpo_gamma: float = 0.5,
    num_pairs: Optional[float] = None,
    weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss (sum over these pairs, times `weights` [B] if given, / `num_pairs`, default B) and per-pair stats [B]:
    `chosen_rewards`, `rejected_rewards`, `margins`, `accuracies` (1.0 where chosen reward > rejected), `losses`.
    """
    if loss_type not in DPO_LOSSES:
        raise ValueError(f"loss_type must be one of {DPO_LOSSES}, got {loss_type!r}")
    if loss_type == "simpo":
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError("simpo needs chosen_lengths and rejected_lengths")
        chosen_rewards = beta * chosen_logps / chosen_lengths
        rejected_rewards = beta * rejected_logps / rejected_lengths
        margin = chosen_rewards - rejected_rewards - simpo_gamma
        losses = -(1 - label_smoothing) * F.logsigmoid(margin) - label_smoothing * F.logsigmoid(-margin)
    else:
        if ref_chosen_logps is None or ref_rejected_logps is None:
            raise ValueError(f"loss_type {loss_type!r} needs reference log-probs")
        chosen_ratio = chosen_logps - ref_chosen_logps
        rejected_ratio = rejected_logps - ref_rejected_logps
        h = chosen_ratio - rejected_ratio
        chosen_rewards, rejected_rewards = beta * chosen_ratio, beta * rejected_ratio
        if loss_type == "sigmoid":
            losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
        elif loss_type == "robust":
            losses = (-(1 - label_smoothing) * F.logsigmoid(beta * h) + label_smoothing * F.logsigmoid(-beta * h)) / (
                1 - 2 * label_smoothing
            )
        elif loss_type == "hinge":
            losses = torch.relu(1 - beta * h)
        elif loss_type == "ipo":
            losses = (h - 1 / (2 * beta)) ** 2
        else:  # apo_zero
            losses = 1 - torch.sigmoid(beta * chosen_ratio) + torch.sigmoid(beta * rejected_ratio)
    chosen_rewards, rejected_rewards = chosen_rewards.detach(), rejected_rewards.detach()
    stats = {
        "chosen_rewards": chosen_rewards,
        "rejected_rewards": rejected_rewards,
        "margins": chosen_rewards - rejected_rewards,
        "accuracies": (chosen_rewards > rejected_rewards).float(),
        "losses": losses.detach(),
    }
    weighted = losses if weights is None else losses * weights
    return weighted.sum() / (num_pairs if num_pairs is not None else losses.shape[0]), stats
