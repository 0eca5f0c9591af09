"""Asynchronous episodes: multi-turn episodes in environments (`model.env`) sampled ahead of the trainer with a fixed
lag (`model.rollout.max_staleness = k > 0`, the schedule of `lit_rl.rollout.asynchronous`).

Generation g's episodes run on the engine's worker (rank 0, `AsyncRolloutEngine.submit_job`) with the weights of
version v(g) while the trainer trains steps v(g) .. g*m - 1; every turn of an episode is sampled by that one
version, so `train/staleness` and the rollout correction mean what they mean for single completions. With in-flight
weight updates (`model.rollout.in_flight_updates`, `lit_rl.rollout.in_flight`) the generations' episodes run side
by side instead, and the engine takes each version staged for a later launch between their turns: each token
records its version, and a row is as stale as its oldest token.

- At launch, on the training thread of rank 0: every rank's rows come to rank 0, which makes an environment per
  row, resets them all at once (`model.env.concurrency`) and renders the prompts (the tokenizer is used on this
  thread only).
- In the background, on the worker: the episodes (`lit_rl.rollout.multi_turn.run_episodes`, each turn seeded by its
  episode and turn), every rank's in one batch, with a copy of the tokenizer for the turns' text and observations.
- When the generation is consumed, each rank gets its transcripts, the environments' reward parts and the first
  environment error (raised on every rank at once), and scores them with the reward functions, as synchronous
  episodes are scored.
- TRL environment classes: the reward functions get the episodes' instances (`environments=`), which live on the
  worker and which no checkpoint could keep. So they score every rank's episodes there, as soon as the episodes
  end, with `trainer_state` at the step that will train on them (g*m, as a synchronous run scores them); each rank
  gets its rows' scores, and a reward function's failure is raised on every rank when the generation is consumed.

A checkpoint waits for the episodes in flight and keeps their finished transcripts (`AsyncGenerations.state_dict`),
and the scores of TRL classes' episodes: the weights that sampled them are not in the checkpoint. A generation whose
episodes failed is kept as its error alone, and a run resumed from that checkpoint samples it again by the current
weights when it takes it (`_sampled_again`).
"""

from __future__ import annotations

import copy
import functools
import queue
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from lit_rl.envs.trl_environments import TRLEnvironment
from lit_rl.errors import ConfigError, EnvironmentStepError, RewardFunctionError
from lit_rl.resume import say
from lit_rl.rewards import TrainerState
from lit_rl.rollout.asynchronous import AsyncGenerations, JobEngine
from lit_rl.rollout.base import ConcurrentEngine, InFlightEngine, RolloutOutput, unpadded_prompts
from lit_rl.rollout.in_flight import oldest_token_versions
from lit_rl.rollout.multi_turn import Episodes, close_environments
from lit_rl.rollout.producer import (
    REWARD_FAILED_ELSEWHERE,
    EpisodeProducer,
    ObservationEncoder,
    ProducerParts,
    SampledAhead,
    ScoredCompletions,
    episodes_start_failure,
    trl_reward_inputs,
)
from lit_rl.types import EPISODE_STATS, model_token_mask


@dataclass
class EpisodeResult:
    """One rank's episodes of a generation, as the worker hands them back (CPU tensors)."""

    prompt_ids: torch.Tensor  # [N, P] left-padded: each episode's first observation, or its row's prompt
    prompt_mask: torch.Tensor
    output: RolloutOutput  # transcripts, with `sampled_mask` and `episode_stats`
    env_rewards: torch.Tensor  # [N, E]
    error: Optional[str]  # the first failure of an environment on any rank
    # TRL environment classes: the reward functions' scores, made on the worker (module docstring)
    reward_components: Optional[torch.Tensor] = None  # [N, F]
    rewards: Optional[torch.Tensor] = None  # [N]
    reward_error: Optional[str] = None


class _TokenizerCopies:
    """Copies of the tokenizer for the worker's jobs, one per job running (a tokenizer is not safe on two threads at
    once; with in-flight weight updates several jobs run at once): taken on the training thread when a generation is
    launched (a new copy made when none is free), given back by the job when it ends."""

    def __init__(self) -> None:
        self._free: queue.SimpleQueue = queue.SimpleQueue()

    def take(self, tokenizer: Any) -> Any:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            return copy.deepcopy(tokenizer)

    def give(self, copied: Any) -> None:
        self._free.put(copied)


class _WorkerEngine:
    """The `generate` that `AsyncRolloutEngine.submit_job` hands the worker, as `run_episodes` calls an engine."""

    def __init__(self, generate: Callable[..., RolloutOutput]) -> None:
        self.generate = generate


class _ConcurrentWorkerEngine(_WorkerEngine):
    """The same, for an engine whose jobs sample with its `concurrent_generate` (a `ConcurrentEngine`): the
    episodes go on on their own. The worker is the one caller, whatever the ranks."""

    concurrent_on_every_rank = True

    def __init__(self, generate: Callable[..., RolloutOutput]) -> None:
        super().__init__(generate)
        self.concurrent_generate = generate


class AsyncEpisodeProducer(SampledAhead, EpisodeProducer):
    """Episodes sampled ahead of the trainer (module docstring).

    Args:
        steps_per_generation: m = `steps_per_generation x num_iterations`.
        max_staleness: k = `model.rollout.max_staleness`.
        in_flight_updates: `model.rollout.in_flight_updates`: the engine takes the versions staged for later
            launches between the episodes' turns (`lit_rl.rollout.in_flight`), instead of only between generations.
        parts, episode_args: as `EpisodeProducer`.
    """

    def __init__(
        self,
        parts: ProducerParts,
        *,
        steps_per_generation: int,
        max_staleness: int,
        in_flight_updates: bool = False,
        **episode_args: Any,
    ) -> None:
        super().__init__(parts, **episode_args)
        self.steps_per_generation = steps_per_generation
        self.max_staleness = max_staleness
        self.in_flight_updates = in_flight_updates
        self.in_flight = AsyncGenerations()
        self._worker_tokenizers = _TokenizerCopies()  # the jobs' own: a tokenizer is not safe on two threads at once
        self._concurrent_jobs = False  # whether the engine's jobs sample with its `concurrent_generate`

    def launch(self, generation: int, rows: list[dict[str, Any]]) -> None:
        """Start `generation`'s episodes in the background with the current weights, those of its version v(g)."""
        version = self.launched_version(generation)
        payload = (rows, self.completion_seeds(len(rows), generation))
        trainer = self.host.trainer  # TRL classes' episodes are scored on the worker, as at the step training on them
        state = TrainerState(generation * self.steps_per_generation, trainer.max_steps, float(trainer.current_epoch))
        engine = self.engine_for_launch()
        self._concurrent_jobs = isinstance(engine, ConcurrentEngine)
        if not isinstance(engine, JobEngine):
            raise ConfigError(
                f"model.env with model.rollout.max_staleness > 0: the engine {type(engine).__name__} samples in the "
                "background but cannot run episodes there (it has no submit_job; see lit_rl.rollout.asynchronous)"
            )
        if self.in_flight_updates:
            if not isinstance(engine, InFlightEngine):
                raise ConfigError(
                    f"model.rollout.in_flight_updates: the engine {type(engine).__name__} cannot take weights while "
                    "it samples (it has no take_weights_in_flight; see lit_rl.rollout.in_flight)"
                )
            engine.take_weights_in_flight()
        with self.host.timer.phase("weight_push"):  # staging the weights, when this version is new
            job = functools.partial(self._episodes_job, state)
            self.in_flight.launch_job(engine, generation, version, payload, job, self.engines.weight_stream)

    def _episodes_job(
        self, state: TrainerState, per_rank: list[tuple[list[dict[str, Any]], list[int]]]
    ) -> Callable[..., list[Any]]:
        """On rank 0's training thread: every rank's environments made and reset, their prompts rendered; returns
        the episodes' work for the worker (`state`: what TRL classes' reward functions see as `trainer_state`)."""
        rows = [row for rank_rows, _ in per_rank for row in rank_rows]
        seeds = [seed for _, rank_seeds in per_rank for seed in rank_seeds]
        counts = [len(rank_rows) for rank_rows, _ in per_rank]
        envs, ended = [], set()
        try:  # the user's environment class and the chat template: a failure is the generation's error
            envs, prompts, reset_error, ended = self.start_episodes(rows)
            encoded, start = [], 0
            for count in counts:  # each rank's prompts padded apart, as its synchronous rollouts are
                # On the CPU: the worker thread sends them to the engine (never through the trainer's device).
                encoded.append(self.encode_prompts(rows[start : start + count], prompts[start : start + count], None))
                start += count
        except Exception as err:
            close_environments(envs, ended, self.runner)  # reset, never to run: their sessions released
            failed = episodes_start_failure(err)
            return lambda generate: [self._failed(count, failed) for count in counts]
        tokenizer = self._worker_tokenizers.take(self.host.tokenizer)
        observations = ObservationEncoder(tokenizer, self.tool_schemas)
        concurrent = self._concurrent_jobs

        def work(generate: Callable[..., RolloutOutput]) -> list[EpisodeResult]:
            try:
                return episodes_of(generate)
            finally:
                self._worker_tokenizers.give(tokenizer)

        def episodes_of(generate: Callable[..., RolloutOutput]) -> list[EpisodeResult]:
            episodes = self.run_episodes(
                _ConcurrentWorkerEngine(generate) if concurrent else _WorkerEngine(generate),
                envs,
                [prompt for ids, mask in encoded for prompt in unpadded_prompts(ids, mask)],
                self.params,
                seeds,
                tokenizer,
                observations.encode,
                torch.device("cpu"),
                ended,
            )
            error = reset_error or episodes.error
            out = episodes.output
            scores, reward_error = None, None
            if error is None and isinstance(envs[0], TRLEnvironment):
                scores, reward_error = self._scored_with_instances(rows, prompts, envs, episodes, tokenizer, state)
            results, start = [], 0
            for (ids, mask), count in zip(encoded, counts):
                rank = slice(start, start + count)
                start += count
                output = RolloutOutput(
                    out.completion_ids[rank],
                    out.completion_mask[rank],
                    out.logprobs[rank],
                    sampled_mask=out.sampled_mask[rank],
                    episode_stats=episodes.stats[rank],
                    token_versions=None if out.token_versions is None else out.token_versions[rank],
                )
                result = EpisodeResult(ids, mask, output, episodes.env_rewards[rank], error, reward_error=reward_error)
                if scores is not None:
                    result.reward_components, result.rewards = scores[0][rank], scores[1][rank]
                results.append(result)
            return results

        return work

    def _scored_with_instances(
        self,
        rows: list[dict[str, Any]],
        prompts: list[Any],
        envs: list[Any],
        episodes: Episodes,
        tokenizer: Any,
        state: TrainerState,
    ) -> tuple[Optional[tuple[torch.Tensor, torch.Tensor]], Optional[str]]:
        """On the worker, every rank's episodes of TRL environment classes scored with their instances (module
        docstring): (components [N, F], rewards [N]), or the reward function's error."""
        episode_rows, instances = trl_reward_inputs(rows, prompts, envs, episodes.unfinished)
        try:
            scores = self.scores(
                episode_rows, 1, episodes.output, tokenizer, torch.device("cpu"), state, episodes.env_rewards, instances
            )
        except RewardFunctionError as err:
            return None, str(err)
        except Exception as err:  # the user's instances or the decoding: the generation's error, not the engine's
            return None, f"scoring the episodes with their environments failed: {type(err).__name__}: {err}"
        return scores, None

    def _sampled_again(self, generation: int, rows: list[dict[str, Any]]) -> ScoredCompletions:
        """A generation whose episodes failed before the checkpoint this run resumed from (an environment's transient
        failure would otherwise stop every resume from it): its episodes run again with their seeds, by the current
        weights (their staleness 0), as a synchronous run resumed from that checkpoint would run them."""
        error = self.in_flight.failed.get(generation)
        say(
            f"generation {generation}'s episodes failed before the checkpoint this run resumed from"
            f"{f' ({error})' if error else ''}: sampling them again by the current weights"
        )
        self.in_flight.forget(generation)
        scored = self.sample(rows, 1, self.params, self.completion_seeds(len(rows), generation))
        if self.in_flight_updates:  # every model token tagged with its version, as the other generations' are
            scored.output.token_versions = scored.token_versions()
        return scored

    def _failed(self, count: int, error: str) -> EpisodeResult:
        """A rank's result of episodes that could not start: `count` empty rows and the error, raised on every rank
        when the generation is consumed (a checkpoint before then keeps the error, and a run resumed from it samples
        the generation again: `_sampled_again`)."""
        empty = torch.zeros(count, 1, dtype=torch.long)
        output = RolloutOutput(
            empty,
            empty.float(),
            empty.float(),
            sampled_mask=empty.float(),
            episode_stats=torch.zeros(count, len(EPISODE_STATS)),
        )
        return EpisodeResult(empty, empty, output, torch.zeros(count, len(self.env_reward_names)), error)

    def generation(
        self, generation: int, rows: list[dict[str, Any]], refills: Optional[list[list[dict[str, Any]]]] = None
    ) -> ScoredCompletions:
        """The launched `generation`'s episodes, finished (waiting for them), scored now; an environment's failure
        raised on every rank. One a checkpoint kept failed on any rank is sampled again, now, on every rank."""
        if generation in self.in_flight.restored and self._any_rank_active(generation in self.in_flight.failed):
            return self._sampled_again(generation, rows)
        sampled = self.take_to_device(generation)
        self.fail_on_every_rank(sampled.error, EnvironmentStepError, "the environment failed on another rank")
        out = sampled.output
        self.host.timer.count("generated_tokens", float(model_token_mask(out).sum()))
        version: int | torch.Tensor = sampled.version
        if out.token_versions is not None:  # in-flight updates: a row is as stale as its oldest token
            version = oldest_token_versions(out.token_versions, model_token_mask(out), sampled.version)
        if sampled.rewards is not None or sampled.reward_error is not None:  # TRL classes: scored on the worker
            self.fail_on_every_rank(sampled.reward_error, RewardFunctionError, REWARD_FAILED_ELSEWHERE)
            components, rewards = sampled.reward_components, sampled.rewards
            return ScoredCompletions(sampled.prompt_ids, sampled.prompt_mask, out, components, rewards, version)
        return self.scored(rows, 1, sampled.prompt_ids, sampled.prompt_mask, out, sampled.env_rewards, version)
