"""Reward functions of an on-policy module: which ones (`model.rewards`), scoring an
engine's completions with them, and failing on every rank together.

`RewardScorer` is a mixin of `OnPolicyModule`; it reads the module's `tokenizer`, `timer`, `trainer`, `device`,
`reward_args` and `reward_names`.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from lit_rl.errors import ConfigError, ReportedOnRankZero, RewardFunctionError
from lit_rl.rewards import TrainerState, import_reward_function, reward_name
from lit_rl.rewards.scoring import reward_components, weighted_reward
from lit_rl.rollout import RolloutOutput
from lit_rl.training.strategies import reduce_across_ranks


class RewardScorer:
    """How an on-policy module scores its completions (module docstring)."""

    def setup_reward_functions(self, reward_funcs: Optional[list[str]], reward_weights: Optional[list[float]]) -> None:
        """Import `reward_funcs` by path (None: the built-in task's correctness reward; an empty list: none, a
        subclass adds its own) with their `reward_weights` (None: 1 each); call it from `__init__`."""
        reward_funcs = ["lit_rl.rewards.arithmetic.correctness"] if reward_funcs is None else reward_funcs
        names = [reward_name(path) for path in reward_funcs]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ConfigError(f"model.rewards.funcs: two functions are named {duplicates[0]!r}; names must be unique")
        self.reward_fns = {name: import_reward_function(path) for name, path in zip(names, reward_funcs)}
        self.reward_weights = torch.tensor(reward_weights or [1.0] * len(reward_funcs), dtype=torch.float32)
        if len(self.reward_weights) != len(reward_funcs):
            raise ConfigError(
                f"model.rewards.weights has {len(self.reward_weights)} values for {len(reward_funcs)} functions in "
                "model.rewards.funcs: give one weight per function (--model.rewards.weights '[1.0, ...]'), or null "
                "for 1.0 each"
            )

    def add_reward_function(self, name: str, fn: Any, weight: float) -> None:
        """Add a reward function that is not imported by path (a reward model); call it from `__init__`."""
        self.reward_fns[name] = fn
        self.reward_weights = torch.cat([self.reward_weights, torch.tensor([weight])])

    def score_output(
        self, rows: list[dict[str, Any]], out: RolloutOutput, repeat: int, env_rewards: Optional[torch.Tensor] = None
    ):
        """Reward components [N, F] and rewards [N] of an engine's completions of `rows` x `repeat`; an
        environment's reward parts [N, E] are further columns, of weight 1."""
        completions = self.tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
        # TRL's `completion_ids`: each completion's tokens up to and including its EOS, without the padding.
        lengths = (out.completion_mask > 0).sum(dim=1).tolist()
        completion_ids = [ids[:n] for ids, n in zip(out.completion_ids.tolist(), lengths)]
        with self.timer.phase("reward"):
            return self._score_on_every_rank(rows, completions, repeat, env_rewards, completion_ids)

    def trainer_state(self) -> TrainerState:
        """Where training is, for reward functions that take `trainer_state` (as TRL passes it)."""
        trainer = self.trainer
        return TrainerState(trainer.global_step, trainer.max_steps, float(trainer.current_epoch))

    def _score_on_every_rank(
        self,
        rows: list[dict[str, Any]],
        completions: list[str],
        repeat: int,
        env_rewards: Optional[torch.Tensor] = None,
        completion_ids: Optional[list[list[int]]] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Reward components [N, F] and weighted rewards [N] (`lit_rl.rewards.scoring`), failing on
        every rank together when they fail on one: a rank that raised alone would leave the others waiting in
        the next collective until a timeout."""
        error: Optional[RewardFunctionError] = None
        components = rewards = None
        try:
            components = reward_components(
                self.reward_fns, rows, completions, repeat, self.device, completion_ids, self.trainer_state()
            )
            weights = self.reward_weights
            if env_rewards is not None:
                components = torch.cat([components, env_rewards.to(components)], dim=1)
                weights = torch.cat([weights, torch.ones(env_rewards.shape[1])])
            invalid = self.reward_args.on_invalid
            rewards = weighted_reward(components, weights, self.reward_names, invalid)
        except RewardFunctionError as err:
            error = err
        elsewhere = "a reward function failed on another rank (its error is above)"
        self.fail_on_every_rank(error, RewardFunctionError, elsewhere)
        return components, rewards

    def fail_on_every_rank(self, error: Optional[Exception | str], kind: type[Exception], elsewhere: str) -> None:
        """Stop every rank when any rank has an `error` (an exception, or a message for `kind`): a rank that raised
        alone would leave the others in the next collective until a timeout. One all-reduce when none failed.
        With several ranks, the error is reported once, by rank 0: the first failed rank's message with its rank
        (`kind`, or `elsewhere` where the message cannot be sent); the other ranks raise `ReportedOnRankZero`,
        which the CLI ends without a line of its own."""
        failed = float(error is not None)
        if self.trainer.world_size > 1:
            flag = torch.tensor(failed, device=self.device)
            failed = float(reduce_across_ranks(flag))
        if not failed:
            return
        if self.trainer.world_size == 1:
            raise error if isinstance(error, Exception) else kind(error or elsewhere)
        messages: list[Optional[str]] = [None] * self.trainer.world_size
        torch.distributed.all_gather_object(messages, None if error is None else str(error))
        rank, message = next((r, m) for r, m in enumerate(messages) if m is not None)
        if self.trainer.global_rank != 0:
            raise ReportedOnRankZero(f"rank {rank} failed; rank 0 reports it") from (
                error if isinstance(error, Exception) else None
            )
        cause = error if isinstance(error, Exception) and rank == 0 else None
        raise kind(f"{message} (on rank {rank})" if message else elsewhere) from cause
