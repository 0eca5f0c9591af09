"""Loss and advantage math as pure functions: tensors in, `(loss, stats)` out. No lightning imports here."""

from lit_rl.losses.advantages import group_advantages
from lit_rl.losses.grpo import (
    AGGREGATIONS,
    IS_CORRECTIONS,
    LossNormalizer,
    aggregate,
    grpo_loss,
    grpo_per_token_loss,
    rollout_is_weights,
    truncated_is_weights,
)

__all__ = [
    "AGGREGATIONS",
    "IS_CORRECTIONS",
    "LossNormalizer",
    "aggregate",
    "group_advantages",
    "grpo_loss",
    "grpo_per_token_loss",
    "rollout_is_weights",
    "truncated_is_weights",
]
