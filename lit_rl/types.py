"""Batches that flow between rollout, losses and the LightningModules.

Shapes use the house names: N = B * G sequences (B prompts, G completions each), P prompt tokens (left-padded),
T completion tokens (right-padded).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from lit_rl.rollout.base import RolloutOutput


# The columns of `RolloutBatch.episode_stats` (multi-turn episodes, `lit_rl.rollout.multi_turn`), each a metric.
EPISODE_STATS = ("turns", "tool_calls", "tool_errors", "env_tokens", "env_timeouts")


@dataclass
class RolloutBatch:
    """One rank's share of a generation: sampled completions, their scores and everything the loss needs."""

    prompt_ids: torch.Tensor  # [N, P] long, left-padded
    prompt_mask: torch.Tensor  # [N, P] long, 1 on real prompt tokens
    completion_ids: torch.Tensor  # [N, T] long, right-padded
    completion_mask: torch.Tensor  # [N, T] float, 1 up to and including the first EOS
    rollout_logprobs: torch.Tensor  # [N, T] float, the engine's log-probs of the sampled tokens
    rewards: torch.Tensor  # [N] float, weighted sum over reward functions
    reward_components: torch.Tensor  # [N, F] float, one column per reward function (unweighted)
    advantages: torch.Tensor  # [N] float (Online DPO: +1 chosen, -1 rejected, 0 both rows of a tied pair)
    group_reward_std: torch.Tensor  # [N] float, std of the rewards of the sequence's group
    old_logprobs: Optional[torch.Tensor] = None  # [N, T], None when the policy is used on-policy once
    ref_logprobs: Optional[torch.Tensor] = None  # [N, T], None without a reference model
    kl: Optional[torch.Tensor] = None  # [N] RLOO: sum_t (old_logprobs - ref_logprobs), the reward penalty's KL
    advantage_std: Optional[torch.Tensor] = None  # [N] RLOO: std of the generation's advantages, on every row
    policy_version: Optional[torch.Tensor] = None  # [N] long, the optimizer steps done by the weights that sampled it
    # In-flight weight updates (`lit_rl.rollout.in_flight`): each token's version [N, T] long (-1 off the model's
    # tokens); `policy_version` is then each row's oldest.
    token_versions: Optional[torch.Tensor] = None
    # Dynamic sampling: the generation's refills and fraction of groups dropped, the same on each of its rows.
    refill_generations: Optional[torch.Tensor] = None  # [N] float
    frac_groups_dropped: Optional[torch.Tensor] = None  # [N] float
    # Multi-turn episodes (`lit_rl.rollout.multi_turn`): 1 on the tokens the model sampled (observations are 0 here,
    # 1 in completion_mask), and the episode statistics (`EPISODE_STATS`: turns, tool calls, tool errors, env tokens,
    # environment steps timed out).
    sampled_mask: Optional[torch.Tensor] = None  # [N, T] float
    episode_stats: Optional[torch.Tensor] = None  # [N, 5] float
    # PPO (`lit_rl.losses.ppo`): the critic's values when sampled, GAE advantages and returns, per token.
    old_values: Optional[torch.Tensor] = None  # [N, T] float
    token_advantages: Optional[torch.Tensor] = None  # [N, T] float, whitened with `loss.normalize_advantages`
    returns: Optional[torch.Tensor] = None  # [N, T] float

    def __len__(self) -> int:
        return self.completion_ids.shape[0]

    def select(self, index: torch.Tensor | slice) -> "RolloutBatch":
        """Rows `index` of every tensor field (a micro-batch of the buffer)."""
        values = {}
        for f in fields(self):
            value = getattr(self, f.name)
            values[f.name] = None if value is None else value[index]
        return replace(self, **values)

    def to(self, device: torch.device) -> "RolloutBatch":
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return replace(self, **{k: None if v is None else v.to(device) for k, v in values.items()})

    def state_dict(self) -> dict[str, Optional[torch.Tensor]]:
        """Plain tensors (on CPU) for a checkpoint, so a resumed run continues the same rollout buffer."""
        return {f.name: None if getattr(self, f.name) is None else getattr(self, f.name).cpu() for f in fields(self)}

    @classmethod
    def from_state_dict(cls, state: dict[str, Optional[torch.Tensor]]) -> "RolloutBatch":
        return cls(**state)


def model_token_mask(batch: RolloutBatch | RolloutOutput) -> torch.Tensor:
    """[N, T]: the completion tokens the model sampled, of a batch or an engine's output: every completion token,
    or with an environment the transcript's model turns (`sampled_mask`), never its observations."""
    if batch.sampled_mask is None:
        return batch.completion_mask
    return batch.completion_mask * batch.sampled_mask
