"""Loss and advantage math as pure functions: tensors in, `(loss, stats)` out. No lightning imports here."""

from lit_rl.losses.advantages import ADVANTAGES, advantage_function, group_advantages
from lit_rl.losses.aggregation import AGGREGATIONS, LossNormalizer, aggregate
from lit_rl.losses.grpo import (
    IS_CORRECTIONS,
    grpo_loss,
    grpo_per_token_loss,
    rollout_is_weights,
)
from lit_rl.losses.policy import POLICY_LOSSES, policy_loss_function

__all__ = [
    "ADVANTAGES",
    "AGGREGATIONS",
    "IS_CORRECTIONS",
    "LossNormalizer",
    "POLICY_LOSSES",
    "advantage_function",
    "aggregate",
    "group_advantages",
    "grpo_loss",
    "grpo_per_token_loss",
    "policy_loss_function",
    "rollout_is_weights",
]
