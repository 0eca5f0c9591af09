"""How a per-token loss becomes the optimizer step's scalar: the named aggregations and their denominators.

Aggregation turns l [N, T] and the completion mask m [N, T] into a scalar; the denominators describe the whole
optimizer step (all micro-batches and ranks), so summing the micro-batch losses gives the exact step loss, whatever
the accumulation and the rank layout:

    sequence : sum_i (sum_t l_it m_it / sum_t m_it) / num_sequences          (GRPO paper)
    token    : sum_it l_it m_it / num_tokens                                  (token mean of the step)
    constant : sum_it l_it m_it / (num_sequences * max_completion_length)    (Dr. GRPO)
    dapo     : sum_it l_it m_it / num_tokens of the whole generation batch    (DAPO)

With a single micro-batch the defaults (`num_sequences = N`, `num_tokens = sum(m)`) give the textbook means.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

import torch

from lit_rl.ops import masked_sum

LossAggregation = Literal["sequence", "token", "constant", "dapo"]


@dataclass(frozen=True)
class LossNormalizer:
    """Denominators of the aggregation, counted over everything one optimizer step (or generation) covers.

    num_sequences: sequences in the optimizer step, all micro-batches and ranks (`sequence`, `constant`).
    num_tokens: completion tokens in the optimizer step, all micro-batches and ranks (`token`).
    num_generation_tokens: completion tokens of the whole generation batch across ranks (`dapo`).
    max_completion_length: the generation budget T_max (`constant`).
    num_active_sequences: sequences with a non-zero advantage in the optimizer step, all ranks (Online DPO
        counts its untied pairs with it).
    """

    num_sequences: float
    num_tokens: float
    num_generation_tokens: float
    max_completion_length: int
    num_active_sequences: float = 0.0

    @classmethod
    def local(cls, completion_mask: torch.Tensor) -> "LossNormalizer":
        """Denominators of a single micro-batch: the textbook definitions (`constant`'s T_max: the mask's width)."""
        tokens = float(completion_mask.sum())
        return cls(
            num_sequences=float(completion_mask.shape[0]),
            num_tokens=tokens,
            num_generation_tokens=tokens,
            max_completion_length=completion_mask.shape[1],
        )


def _sequence(per_token: torch.Tensor, mask: torch.Tensor, norm: LossNormalizer) -> torch.Tensor:
    per_sequence = masked_sum(per_token, mask, dim=1) / mask.sum(dim=1).clamp(min=1)  # [N]
    return per_sequence.sum() / norm.num_sequences


def _token(per_token: torch.Tensor, mask: torch.Tensor, norm: LossNormalizer) -> torch.Tensor:
    return masked_sum(per_token, mask) / max(norm.num_tokens, 1.0)


def _constant(per_token: torch.Tensor, mask: torch.Tensor, norm: LossNormalizer) -> torch.Tensor:
    return masked_sum(per_token, mask) / (norm.num_sequences * norm.max_completion_length)


def _dapo(per_token: torch.Tensor, mask: torch.Tensor, norm: LossNormalizer) -> torch.Tensor:
    return masked_sum(per_token, mask) / max(norm.num_generation_tokens, 1.0)


AGGREGATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor, LossNormalizer], torch.Tensor]] = {
    "sequence": _sequence,
    "token": _token,
    "constant": _constant,
    "dapo": _dapo,
}


def aggregate(
    per_token: torch.Tensor, completion_mask: torch.Tensor, aggregation: str, normalizer: LossNormalizer
) -> torch.Tensor:
    """Reduce a per-token quantity [N, T] to a scalar with the named aggregation (see the module docstring)."""
    try:
        reduce = AGGREGATIONS[aggregation]
    except KeyError:
        raise ValueError(f"model.loss.aggregation must be one of {sorted(AGGREGATIONS)}, got {aggregation!r}") from None
    return reduce(per_token, completion_mask, normalizer)
