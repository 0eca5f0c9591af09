"""Batches that flow between rollout, losses and the LightningModules.

Shapes use the house names: N = B * G sequences (B prompts, G completions each), P prompt tokens (left-padded),
T completion tokens (right-padded).
"""

from __future__ import annotations

from dataclasses import Field, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Optional

import torch

from lit_rl.errors import ConfigError

if TYPE_CHECKING:
    from lit_rl.rollout.base import RolloutOutput


# The columns of `RolloutBatch.episode_stats` (multi-turn episodes, `lit_rl.rollout.multi_turn`), each a metric.
EPISODE_STATS = ("turns", "tool_calls", "tool_errors", "env_tokens", "env_timeouts")


def prompt_field(required: bool = False, fill: float | str = 0) -> Any:
    """A field [N, P] laid out like the prompts (left-padded): ranks exchanging rows widen it on the left with
    `fill` (`"pad"`: the tokenizer's pad id). None until set unless `required` (only `RolloutBatch`'s own fields
    are: a subclass's fields follow them, and must have a default)."""
    return _laid_out("prompt", required, fill)


def completion_field(required: bool = False, fill: float | str = 0) -> Any:
    """A field [N, T] laid out like the completions (right-padded): ranks exchanging rows widen it on the right
    with `fill`; None until set unless `required` (as `prompt_field`)."""
    return _laid_out("completion", required, fill)


def _laid_out(kind: str, required: bool, fill: float | str) -> Any:
    metadata = {"layout": kind, "fill": fill}
    return field(metadata=metadata) if required else field(default=None, metadata=metadata)


def layout(f: Field) -> str:
    """`prompt`, `completion` (`prompt_field`, `completion_field`), or `row`: one value [N, ...] per sequence."""
    return f.metadata.get("layout", "row")


def fill(f: Field, pad_id: int) -> float:
    """What a prompt or completion field is widened with."""
    value = f.metadata.get("fill", 0)
    return pad_id if value == "pad" else value


@dataclass
class RolloutBatch:
    """One rank's share of a generation: sampled completions, their scores and everything the loss needs. An
    algorithm with fields of its own subclasses it beside its loss (`GRPOBatch`, `PPOBatch`, `RLOOBatch`) and names
    the subclass in `OnPolicyModule.batch_type`."""

    prompt_ids: torch.Tensor = prompt_field(required=True, fill="pad")  # [N, P] long, left-padded
    prompt_mask: torch.Tensor = prompt_field(required=True)  # [N, P] long, 1 on real prompt tokens
    completion_ids: torch.Tensor = completion_field(required=True, fill="pad")  # [N, T] long, right-padded
    completion_mask: torch.Tensor = completion_field(required=True)  # [N, T] float, 1 up to and including the first EOS
    rollout_logprobs: torch.Tensor = completion_field(required=True)  # [N, T] float, the engine's log-probs
    rewards: torch.Tensor  # [N] float, weighted sum over reward functions
    reward_components: torch.Tensor  # [N, F] float, one column per reward function (unweighted)
    advantages: torch.Tensor  # [N] float (Online DPO: +1 chosen, -1 rejected, 0 both rows of a tied pair)
    group_reward_std: torch.Tensor  # [N] float, std of the rewards of the sequence's group
    old_logprobs: Optional[torch.Tensor] = completion_field()  # [N, T], None when the policy is used on-policy once
    ref_logprobs: Optional[torch.Tensor] = completion_field()  # [N, T], None without a reference model
    policy_version: Optional[torch.Tensor] = None  # [N] long, the optimizer steps done by the weights that sampled it
    # In-flight weight updates (`lit_rl.rollout.in_flight`): each token's version [N, T] long (-1 off the model's
    # tokens); `policy_version` is then each row's oldest.
    token_versions: Optional[torch.Tensor] = completion_field(fill=-1)
    # Multi-turn episodes (`lit_rl.rollout.multi_turn`): 1 on the tokens the model sampled (observations are 0 here,
    # 1 in completion_mask), and the episode statistics (`EPISODE_STATS`: turns, tool calls, tool errors, env tokens,
    # environment steps timed out).
    sampled_mask: Optional[torch.Tensor] = completion_field()  # [N, T] float
    episode_stats: Optional[torch.Tensor] = None  # [N, 5] float
    # [N, T] float, the tokens the loss and its denominators count: the algorithm's `loss_mask`, once per batch
    loss_mask: Optional[torch.Tensor] = completion_field()

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
        """The batch `state_dict` saved. A checkpoint of an earlier lit-rl holds every algorithm's fields in one
        batch: another algorithm's, all None there, are dropped."""
        names = {f.name for f in fields(cls)}
        foreign = sorted(name for name, value in state.items() if name not in names and value is not None)
        if foreign:
            raise ConfigError(
                f"the checkpoint's rollout buffer has fields {cls.__name__} does not: {foreign} (it was written by "
                "another algorithm, or a newer lit-rl: resume it with that algorithm, or that lit-rl)"
            )
        return cls(**{name: value for name, value in state.items() if name in names})


def model_token_mask(batch: RolloutBatch | RolloutOutput) -> torch.Tensor:
    """[N, T]: the completion tokens the model sampled, of a batch or an engine's output: every completion token,
    or with an environment the transcript's model turns (`sampled_mask`), never its observations."""
    if batch.sampled_mask is None:
        return batch.completion_mask
    return batch.completion_mask * batch.sampled_mask
