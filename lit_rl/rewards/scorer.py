"""The reward functions of an on-policy run (`model.rewards`) as one part: which functions, their weights, and the
scores of a batch of completions. It reads nothing of its holder (the rollout producer, `lit_rl.rollout.producer`):
the producer passes what a score needs (the decoded completions, the device, where training is) and stops every
rank together when one fails.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from lit_rl.errors import ConfigError
from lit_rl.rewards import TrainerState, import_reward_function, reward_name
from lit_rl.rewards.scoring import reward_components, weighted_reward

if TYPE_CHECKING:  # the config imports Lightning; reward scoring does not need it
    from lit_rl.config import RewardArgs

DEFAULT_REWARD = "lit_rl.rewards.arithmetic.correctness"  # the built-in task's


class RewardScorer:
    """The run's reward functions, by name, and their weights.

    Args:
        args: `model.rewards`: the functions by import path (None: the built-in task's correctness reward; an empty
            list: none, an algorithm adds its own with `add`), their weights (None: 1 each) and what an invalid
            reward counts as (`on_invalid`).
    """

    def __init__(self, args: RewardArgs) -> None:
        paths = [DEFAULT_REWARD] if args.funcs is None else args.funcs
        names = [reward_name(path) for path in paths]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ConfigError(f"model.rewards.funcs: two functions are named {duplicates[0]!r}; names must be unique")
        self.functions: dict[str, Any] = {name: import_reward_function(path) for name, path in zip(names, paths)}
        self.weights = torch.tensor(args.weights or [1.0] * len(paths), dtype=torch.float32)
        if len(self.weights) != len(paths):
            raise ConfigError(
                f"model.rewards.weights has {len(self.weights)} values for {len(paths)} functions in "
                "model.rewards.funcs: give one weight per function (--model.rewards.weights '[1.0, ...]'), or null "
                "for 1.0 each"
            )
        self.on_invalid = args.on_invalid

    @property
    def names(self) -> list[str]:
        """The functions' names, in column order."""
        return list(self.functions)

    def add(self, name: str, fn: Any, weight: float) -> None:
        """Add a reward function that is not imported by path (a reward model)."""
        self.functions[name] = fn
        self.weights = torch.cat([self.weights, torch.tensor([weight])])

    def score(
        self,
        rows: list[dict[str, Any]],
        completions: list[str],
        completion_ids: list[list[int]],
        repeat: int,
        device: torch.device,
        state: TrainerState,
        names: Sequence[str],
        env_rewards: Optional[torch.Tensor] = None,
        environments: Optional[list[Any]] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Reward components [N, F] and weighted rewards [N] (`lit_rl.rewards.scoring`) of the completions of
        `rows` x `repeat`; an environment's reward parts [N, E] are further columns, of weight 1. `names`: every
        column's name, for the messages about invalid rewards; `environments`: the episodes' environments, one per
        completion, passed as `environments=` (TRL's keyword). Raises `RewardFunctionError`."""
        components = reward_components(
            self.functions, rows, completions, repeat, device, completion_ids, state, environments
        )
        weights = self.weights
        if env_rewards is not None:
            components = torch.cat([components, env_rewards.to(components)], dim=1)
            weights = torch.cat([weights, torch.ones(env_rewards.shape[1])])
        return components, weighted_reward(components, weights, list(names), self.on_invalid)
