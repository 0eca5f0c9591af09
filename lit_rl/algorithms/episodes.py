"""Multi-turn rollouts in an environment, for the on-policy algorithms (GRPO, RLOO, PPO, Online DPO): the settings,
the episodes of a batch, and what their transcripts add to the rewards and the metrics.

With `model.env.environment` (or `model.env.tools`) a completion is an episode's transcript after the prompt (model
turns and observations, token-in and token-out: `lit_rl.rollout.multi_turn`); the loss and every token metric count the
model's tokens only (`RolloutBatch.sampled_mask`), and the reward is the environment's reward parts (columns
`env/<part>`, weight 1) plus the reward functions on the decoded transcript.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from lit_rl.config import EnvArgs
from lit_rl.envs import environment_factory
from lit_rl.rollout import SamplingParams
from lit_rl.rollout.base import unpadded_prompts
from lit_rl.rollout.multi_turn import EPISODE_STATS, Episodes, run_episodes
from lit_rl.training.strategies import reduce_across_ranks


class EpisodeRunner:
    """Mixin of `OnPolicyModule`: `setup_environment` in `__init__`, then `sample_episodes` instead of one
    `generate` call when `env_factory` is set."""

    env_factory = None
    env_reward_names: tuple[str, ...] = ()

    def setup_environment(self, env: EnvArgs) -> None:
        self.env_factory, self.env_reward_names = environment_factory(env.environment, env.environment_args, env.tools)

    @property
    def max_total_tokens(self) -> int:
        """The transcript's budget: model and observation tokens after the prompt (default: every turn's budget,
        `max_turns x max_new_tokens`)."""
        env = self.env_args
        return env.max_total_tokens or env.max_turns * self.sampling_args.max_new_tokens

    @property
    def reward_names(self) -> list[str]:
        """The reward columns: one per reward function, then the environment's parts (`env/<part>`)."""
        return [*self.reward_scorer.names, *(f"env/{name}" for name in self.env_reward_names)]

    @property
    def completion_budget(self) -> int:
        """The most tokens one completion can hold: `max_new_tokens`, or with an environment the transcript's."""
        return self.max_total_tokens if self.env_factory is not None else self.sampling_args.max_new_tokens

    def sample_episodes(
        self, rows: list[dict[str, Any]], repeat: int, params: SamplingParams, seeds: Optional[list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor, Episodes]:
        """One episode per row x `repeat`, each with an environment of its own: the prompts (each episode's first
        observation, or its row's prompt) as left-padded ids [N, P] and mask, and the episodes."""
        envs = [self.env_factory() for _ in range(len(rows) * repeat)]
        prompts, error = [], None
        for index, env in enumerate(envs):
            row = rows[index // repeat]
            try:
                first = env.reset(row)
            except Exception as err:  # raised on every rank together, after the episodes' collectives
                error = error or f"{type(env).__name__}.reset raised {type(err).__name__}: {err}"
                first = None
            prompts.append(row["prompt"] if first is None else first)
        prompt_ids, prompt_mask = self.encode_prompts(prompts)
        tokenizer = self.tokenizer
        episodes = run_episodes(
            self.engine(),
            envs,
            unpadded_prompts(prompt_ids, prompt_mask),
            params,
            seeds,
            decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
            # Special tokens' text in an observation (a tool echoing "<|endoftext|>") stays text.
            encode_observation=lambda text: tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True),
            reward_names=self.env_reward_names,
            max_turns=self.env_args.max_turns,
            max_total_tokens=self.max_total_tokens,
            pad_id=tokenizer.pad_token_id,
            device=self.device,
            env_name=type(envs[0]).__name__,
            any_active=self._any_rank_active,
        )
        episodes.output.episode_stats = episodes.stats
        episodes.error = error or episodes.error
        return prompt_ids, prompt_mask, episodes

    def _any_rank_active(self, active: bool) -> bool:
        """Whether any rank still has episodes running (every rank calls it once per turn)."""
        if self.trainer.world_size == 1:
            return active
        flag = torch.tensor(float(active), device=self.device)
        return bool(reduce_across_ranks(flag) > 0)

    def update_episode_metrics(
        self, metrics: Any, stats: Optional[torch.Tensor], weight: Optional[torch.Tensor] = None
    ):
        """Each episode's `EPISODE_STATS` into the collection's metrics of the same names (means per episode)."""
        if stats is None:
            return
        weight = torch.ones_like(stats[:, 0]) if weight is None else weight
        for column, name in enumerate(EPISODE_STATS):
            metrics[name].update(stats[:, column], weight)
