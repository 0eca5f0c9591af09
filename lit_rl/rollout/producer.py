"""The one interface an on-policy module asks for its rollouts: `generation(g, rows, refills)` returns this rank's
scored completions of generation g (`ScoredCompletions`), with the policy version that sampled them.

- `RolloutProducer`: synchronous; generation g is sampled when asked, by the current weights.
- `EpisodeProducer`: synchronous, each completion an episode's transcript in an environment
  (`model.env`, `lit_rl.rollout.multi_turn`).
- `AsyncProducer`: generations launched ahead (`launch`) and sampled in the background with a fixed lag
  (`model.rollout.max_staleness`, `lit_rl.rollout.asynchronous`); `generation` takes the finished one.
- `DynamicSampling` (`lit_rl.rollout.dynamic_sampling`) wraps any of them: refill generations replace the groups
  whose rewards all agree.

A producer owns what makes a rollout: the engine (`EngineOwner`), the reward scoring (`RewardScorer`) and the
environments. The module keeps the loss, its metrics and the checkpoint, into which it saves the producer's state
(`state_dict`: the generations launched ahead). Every call is made on every rank, in the same order.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from lit_rl.envs.base import ClosesEpisode, TokenIds, env_label
from lit_rl.envs.chat_tools import ChatRenderer, chat_prompt
from lit_rl.envs.runner import EnvCallTimeout, EnvironmentRunner
from lit_rl.envs.trl_environments import EnvironmentRouting, TRLEnvironment
from lit_rl.errors import ConfigError, DataError, EnvironmentStepError, LitRLError, RewardFunctionError, exception_line
from lit_rl.modeling.models import model_eos_token_ids
from lit_rl.modeling.prompts import PromptEncoder
from lit_rl.rewards import TrainerState
from lit_rl.rewards.scorer import ENV_PART_PREFIX, RewardScorer
from lit_rl.rollout.asynchronous import AsyncGenerations, PendingGeneration, generation_version
from lit_rl.rollout.base import (
    ConcurrentEngine,
    RankLocalEngine,
    RolloutOutput,
    SamplingParams,
    global_batch_seeds,
    unpadded_prompts,
)
from lit_rl.rollout.engine_owner import EngineOwner
from lit_rl.rollout.host import RolloutHost
from lit_rl.rollout.multi_turn import Episodes, close_environments, run_episodes
from lit_rl.training.strategies import fail_on_every_rank, reduce_across_ranks
from lit_rl.types import model_token_mask


@dataclass(frozen=True)
class GroupFilterStats:
    """Dynamic sampling's numbers of a generation (`lit_rl.rollout.dynamic_sampling`), which GRPO logs."""

    refill_generations: int  # the refill generations it sampled
    frac_groups_dropped: float  # the share of the sampled groups its filter dropped


@dataclass
class ScoredCompletions:
    """This rank's completions of a generation, scored: what a producer hands the module."""

    prompt_ids: torch.Tensor  # [N, P] left-padded
    prompt_mask: torch.Tensor  # [N, P]
    output: RolloutOutput  # completions [N, T] (with an environment: transcripts, and `sampled_mask`)
    reward_components: torch.Tensor  # [N, F], one column per reward (`RolloutProducer.reward_names`)
    rewards: torch.Tensor  # [N] weighted sum
    # The policy version (optimizer steps done) that sampled them: one for all, or per row [N] (dynamic sampling's
    # refills under asynchronous rollouts are sampled by newer weights than the generation they top up).
    version: int | torch.Tensor
    group_filter: Optional[GroupFilterStats] = None  # dynamic sampling's numbers; None without it

    def row_versions(self) -> torch.Tensor:
        """The policy version of each row [N] (long)."""
        if isinstance(self.version, torch.Tensor):
            return self.version.to(device=self.rewards.device, dtype=torch.long)
        return torch.full_like(self.rewards, self.version, dtype=torch.long)

    def token_versions(self) -> torch.Tensor:
        """Each model token's version [N, T] (-1 elsewhere): the engine's (in-flight weight updates), else its
        row's; so that completions with them and without (sampled by the current weights) stack."""
        out = self.output
        if out.token_versions is not None:
            return out.token_versions
        versions = self.row_versions()[:, None].expand_as(out.completion_ids)
        return torch.where(model_token_mask(out) > 0, versions, torch.full_like(versions, -1))


@dataclass(frozen=True)
class ProducerParts:
    """What every producer is made of.

    Args:
        host: the module that trains the policy (`RolloutHost`).
        engines: the run's engine (`EngineOwner`), shared with the module.
        scorer: the reward functions (`model.rewards`).
        params: how training samples (`SamplingParams` of `model.sampling`; its `max_new_tokens`, the budget of
            one completion, of one turn in episodes).
        prompts: the module's prompt encoder (`lit_rl.modeling.prompts`), so that a prompt is sampled from as the
            module reads it.
    """

    host: RolloutHost
    engines: EngineOwner
    scorer: RewardScorer
    params: SamplingParams
    prompts: PromptEncoder


log = logging.getLogger(__name__)

REWARD_FAILED_ELSEWHERE = "a reward function failed on another rank (its error is above)"


def rank_slice(rank: int, n: int) -> slice:
    """Rank `rank`'s rows of a tensor gathered from every rank with `n` rows each."""
    return slice(rank * n, (rank + 1) * n)


class RolloutProducer:
    """Samples and scores a generation when asked (module docstring), from its `ProducerParts`."""

    def __init__(self, parts: ProducerParts) -> None:
        self.host = parts.host
        self.engines = parts.engines
        self.scorer = parts.scorer
        self.params = parts.params
        self.prompts = parts.prompts

    # -- what the module reads -------------------------------------------------------------------------------
    @property
    def reward_names(self) -> list[str]:
        """The reward columns, in order: one per reward function."""
        return self.scorer.names

    @property
    def completion_budget(self) -> int:
        """The most tokens one completion can hold."""
        return self.params.max_new_tokens

    # -- generations -----------------------------------------------------------------------------------------
    def generation(
        self, generation: int, rows: list[dict[str, Any]], refills: Optional[list[list[dict[str, Any]]]] = None
    ) -> ScoredCompletions:
        """This rank's completions of `generation`, one per row of `rows` (the loader repeats each prompt for its
        group), sampled now with seeds of the generation (`completion_seeds`). `refills`: the prompt rows the
        loader offers for refill generations (used by `DynamicSampling` alone)."""
        return self.sample(rows, 1, self.params, self.completion_seeds(len(rows), generation))

    # Whether `generation` may sample more when it is called (dynamic sampling's refills, by the current weights):
    # the module then launches the generations after it only once it has it (see `SampledAhead.sample`).
    samples_when_taken = False
    refills_offered = 0  # the refill generations the loader offers with each generation (dynamic sampling's)

    def launch(self, generation: int, rows: list[dict[str, Any]]) -> None:
        """Start sampling `generation` ahead: only asynchronous producers do."""
        raise RuntimeError(f"{type(self).__name__} samples each generation when asked; it launches none ahead")

    def sample(
        self, rows: list[dict[str, Any]], repeat: int, params: SamplingParams, seeds: Optional[list[int]] = None
    ) -> ScoredCompletions:
        """`rows` x `repeat` completions, scored (one seed per completion when `seeds` are given, else drawn from
        the global RNG, as validation samples). The engine gets the current weights first."""
        prompt_ids, prompt_mask = self.prompts.encode([row["prompt"] for row in rows], device=self.host.device)
        prompt_ids = prompt_ids.repeat_interleave(repeat, dim=0)  # [N*repeat, P]
        prompt_mask = prompt_mask.repeat_interleave(repeat, dim=0)
        engine = self.engines.engine()  # pushes the policy's weights first when the engine needs them
        timer = self.host.timer
        with timer.phase("generation"):
            out = engine.generate(prompt_ids, prompt_mask, params, seeds=seeds)
        timer.count("generated_tokens", float(out.completion_mask.sum()))
        return self.scored(rows, repeat, prompt_ids, prompt_mask, out)

    def completion_seeds(self, n: int, generation: int) -> list[int]:
        """Sampling seeds of this rank's `n` completions of `generation`: slices of one list for the global batch
        (`global_batch_seeds`), so that a completion's sample depends on the run's seed, the generation and its
        place in the global batch, never on how the batch is split across ranks. The loader gives each rank a
        consecutive slice of the generation's prompts, so rank r holds completions r*n..r*n+n-1."""
        trainer = self.host.trainer
        run_seed = int(os.environ.get("PL_GLOBAL_SEED", 0))  # `seed_everything`'s seed, the same on every rank
        seeds = global_batch_seeds(run_seed, generation, n * trainer.world_size)
        return seeds[rank_slice(trainer.global_rank, n)]

    # -- scoring ---------------------------------------------------------------------------------------------
    def scored(
        self,
        rows: list[dict[str, Any]],
        repeat: int,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        out: RolloutOutput,
        env_rewards: Optional[torch.Tensor] = None,
        version: Optional[int | torch.Tensor] = None,
        environments: Optional[list[Any]] = None,
    ) -> ScoredCompletions:
        """The engine's completions of `rows` x `repeat` with their rewards (`RewardScorer.score`); `version`:
        the policy version that sampled them (default: the current one); `environments`: the episodes' environments,
        passed to the reward functions as TRL does. Fails on every rank together when a reward function fails on
        one."""
        host, trainer = self.host, self.host.trainer
        state = TrainerState(trainer.global_step, trainer.max_steps, float(trainer.current_epoch))
        error: Optional[RewardFunctionError] = None
        components = rewards = None
        with host.timer.phase("reward"):
            try:
                components, rewards = self.scores(
                    rows, repeat, out, host.tokenizer, host.device, state, env_rewards, environments
                )
            except RewardFunctionError as err:
                error = err
            self.fail_on_every_rank(error, RewardFunctionError, REWARD_FAILED_ELSEWHERE)
        version = trainer.global_step if version is None else version
        return ScoredCompletions(prompt_ids, prompt_mask, out, components, rewards, version)

    def scores(
        self,
        rows: list[dict[str, Any]],
        repeat: int,
        out: RolloutOutput,
        tokenizer: Any,
        device: torch.device,
        state: TrainerState,
        env_rewards: Optional[torch.Tensor] = None,
        environments: Optional[list[Any]] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Reward components [N, F] and weighted rewards [N] (`RewardScorer.score`) of `out`'s completions of `rows`
        x `repeat`, decoded with `tokenizer`, the functions seeing `state` as `trainer_state`. Raises
        `RewardFunctionError`; collective-free (asynchronous TRL episodes score on the engine's worker)."""
        completions = tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
        # TRL's `completion_ids`: each completion's tokens up to and including its EOS, without the padding.
        lengths = (out.completion_mask > 0).sum(dim=1).tolist()
        completion_ids = [ids[:n] for ids, n in zip(out.completion_ids.tolist(), lengths)]
        return self.scorer.score(
            rows, completions, completion_ids, repeat, device, state, self.reward_names, env_rewards, environments
        )

    def fail_on_every_rank(self, error: Optional[Exception | str], kind: type[Exception], elsewhere: str) -> None:
        """`lit_rl.training.strategies.fail_on_every_rank` over the trainer's ranks."""
        trainer = self.host.trainer
        fail_on_every_rank(error, kind, elsewhere, trainer.world_size, trainer.global_rank, self.host.device)

    # -- around training -------------------------------------------------------------------------------------
    def release(self) -> None:
        """After a rollout: the engine may release its device memory (sleep mode) for the update."""
        self.engines.release()

    def before_validation(self) -> None:
        """The engine is about to sample by the current weights, pushed now (validation, dynamic sampling's
        refills)."""

    def state_dict(self) -> Optional[list[dict[str, Any]]]:
        """What a checkpoint keeps of this rank's production (None: nothing; it samples when asked)."""
        return None

    def load_state_dict(self, state: Optional[list[dict[str, Any]]]) -> None:
        """Restore `state_dict`'s."""

    def close(self) -> None:
        """End of fit or validation: the engine is closed, anything in flight abandoned."""
        self.engines.close()


class EpisodeProducer(RolloutProducer):
    """Each completion is an episode's transcript in an environment of its own (`lit_rl.rollout.multi_turn`): the
    loss and every token metric count the model's tokens only (`RolloutOutput.sampled_mask`), and the reward is the
    environment's reward parts (columns `env/<part>`, weight 1) plus the reward functions on the decoded transcript.

    Args:
        env_factory: makes one environment per episode (`lit_rl.envs.environment_factory`).
        env_reward_names: the reward parts its episodes report.
        max_turns: `model.env.max_turns`.
        max_total_tokens: `model.env.max_total_tokens` (None: `max_turns x max_new_tokens`).
        runner: runs the environments' `reset` and `step` calls (`model.env.concurrency`, `step_timeout_s`).
        tool_schemas: the JSON schemas of tools the model calls in its chat format (`lit_rl.envs.chat_tools`): the
            prompts are rendered with them, and a text prompt becomes a user message. None: no such tools.
        independent_turns: `model.env.independent_turns`: episodes go on on their own on an engine with a
            `concurrent_generate` (with several processes, one whose `concurrent_on_every_rank` is true); turn by
            turn otherwise.
        raw_turns: each turn reaches `step` decoded with its special tokens (`EnvironmentSpec.raw_turns`).
        routing: with several environments by name, how a row picks its own (`EnvironmentSpec.routing`).
        ready_batches: `model.env.ready_batches`: on one process, or each process apart with an engine whose
            calls involve no other rank, an engine without a `concurrent_generate` samples the turns of the episodes
            that are ready (`lit_rl.rollout.multi_turn`); turn by turn otherwise.
        parts: `ProducerParts`.
    """

    def __init__(
        self,
        parts: ProducerParts,
        *,
        env_factory: Callable[..., Any],
        env_reward_names: tuple[str, ...],
        max_turns: int,
        max_total_tokens: Optional[int],
        runner: EnvironmentRunner,
        tool_schemas: Optional[list[dict[str, Any]]] = None,
        independent_turns: bool = True,
        raw_turns: bool = False,
        routing: Optional[EnvironmentRouting] = None,
        ready_batches: bool = False,
    ) -> None:
        super().__init__(parts)
        self.runner = runner
        self._stop_ids: Optional[frozenset[int]] = None
        self.ready_batches = ready_batches
        self.routing = routing
        self.raw_turns = raw_turns
        self.independent_turns = independent_turns
        self.tool_schemas = tool_schemas
        self._observations: Optional[ObservationEncoder] = None
        if tool_schemas is not None:  # a template that cannot render a tool result fails now, not mid-training
            probe = [{"role": "tool", "name": tool_schemas[0]["function"]["name"], "content": "probe"}]
            try:
                self.encode_observation(probe, [])
            except Exception as err:
                raise ConfigError(
                    f"model.env.tools: the tokenizer's chat template cannot render a tool result after a turn: {err}"
                ) from None
        self.env_factory = env_factory
        self.env_reward_names = env_reward_names
        self.max_turns = max_turns
        self.max_total_tokens = max_total_tokens or max_turns * parts.params.max_new_tokens

    @property
    def reward_names(self) -> list[str]:
        """One column per reward function, then the environment's parts (`env/<part>`)."""
        return [*self.scorer.names, *(ENV_PART_PREFIX + name for name in self.env_reward_names)]

    @property
    def completion_budget(self) -> int:
        """A transcript's budget: model and observation tokens after the prompt."""
        return self.max_total_tokens

    def sample(
        self, rows: list[dict[str, Any]], repeat: int, params: SamplingParams, seeds: Optional[list[int]] = None
    ) -> ScoredCompletions:
        """One episode per row x `repeat`, each with an environment of its own, from its first observation (or
        its row's prompt), scored."""
        host = self.host
        if self.routing is not None:  # checked at fit start too; here a bad row stops every rank, not one
            self.fail_on_every_rank(self.routing.check(rows), DataError, "a row on another rank names no environment")
        with host.timer.phase("generation"):
            rows_of = [rows[index // repeat] for index in range(len(rows) * repeat)]
            start_error, envs, ended = None, [], set()
            try:  # the user's environment class and the chat template: a failure is this rank's alone
                envs, prompts, error, ended = self.start_episodes(rows_of)
                prompt_ids, prompt_mask = self.encode_prompts(rows_of, prompts, host.device)
            except Exception as err:
                if not isinstance(err, LitRLError):  # a defect in the user's class or template: its traceback too
                    log.exception("the episodes on rank %d could not start", host.trainer.global_rank)
                start_error = episodes_start_failure(err)
            # Raised on every rank together: a rank that raised alone would leave the others in the turns' collectives.
            try:
                elsewhere = "the episodes could not start on another rank"
                self.fail_on_every_rank(start_error, EnvironmentStepError, elsewhere)
            except Exception:  # this rank's failure or another's (`ReportedOnRankZero` off rank 0)
                close_environments(envs, ended, self.runner)  # reset, never to run: their sessions released
                raise
            engine = self.engines.engine()
            one_rank = host.trainer.world_size == 1
            # With several ranks, each rank's episodes go on on their own only where every rank may sample alone.
            alone = one_rank or (isinstance(engine, ConcurrentEngine) and engine.concurrent_on_every_rank)
            # ... and take turns in ready batches only where no other rank takes part in a call.
            single_caller = one_rank or (isinstance(engine, RankLocalEngine) and engine.rank_local)
            independent = independent_generate(engine, self.independent_turns and alone) is not None
            apart = not one_rank and (independent or (self.ready_batches and single_caller))
            episodes, engine_error = None, None
            try:
                episodes = self.run_episodes(
                    engine,
                    envs,
                    unpadded_prompts(prompt_ids, prompt_mask),
                    params,
                    seeds,
                    host.tokenizer,
                    self.encode_observation,
                    host.device,
                    ended,
                    any_active=self._any_rank_active,
                    concurrent=alone,
                    first_turns_together=one_rank,
                    single_caller=single_caller,
                )
            except Exception as err:  # the ranks sampled apart: a failure is this rank's alone, to raise on every rank
                if not apart:  # lock-step's engine calls are collectives: every rank has the engine's error already
                    raise
                if not isinstance(err, LitRLError):  # a defect, not a failure: its traceback, on the rank it happened
                    log.exception("episodes on rank %d failed", host.trainer.global_rank)
                engine_error = err if isinstance(err, LitRLError) else f"episodes: {type(err).__name__}: {err}"
        # A rank whose episodes ended first waits here for the others' (one collective, not one per turn): a rollout
        # longer than the process group's timeout needs a longer one (Lightning's `DDPStrategy(timeout=...)`).
        self.fail_on_every_rank(engine_error, LitRLError, "the rollout engine failed on another rank")
        episodes.output.episode_stats = episodes.stats
        self.fail_on_every_rank(error or episodes.error, EnvironmentStepError, "the environment failed on another rank")
        out = episodes.output
        host.timer.count("generated_tokens", float(model_token_mask(out).sum()))
        if isinstance(envs[0], TRLEnvironment):
            episode_rows, instances = trl_reward_inputs(rows_of, prompts, envs, episodes.unfinished)
            return self.scored(
                episode_rows, 1, prompt_ids, prompt_mask, out, episodes.env_rewards, environments=instances
            )
        return self.scored(rows, repeat, prompt_ids, prompt_mask, out, episodes.env_rewards)

    def run_episodes(
        self,
        engine: Any,
        envs: list[Any],
        prompts: list[list[int]],
        params: SamplingParams,
        seeds: Optional[list[int]],
        tokenizer: Any,
        encode_observation: Callable[[Any, list[int]], list[int]],
        device: torch.device,
        ended: set[int],
        any_active: Callable[[bool], bool] = bool,
        concurrent: bool = True,
        first_turns_together: bool = True,
        single_caller: bool = True,
    ) -> Episodes:
        """`lit_rl.rollout.multi_turn.run_episodes` with this producer's settings (reward parts, turns, token budget,
        runner), the turns decoded and padded with `tokenizer`. `concurrent`: this rank may sample with no other
        rank in the call (one process, a job's worker, or an engine whose `concurrent_generate` every rank may call
        at once); episodes then go on on their own when the engine has a `concurrent_generate` and
        `independent_turns` is on, and otherwise, with `ready_batches` on and `single_caller` (no other rank takes
        part in the engine's calls: one process, a job's worker, or a `RankLocalEngine`), in batches of the turns
        that are ready (a rank's number of calls then depends on timing, which a collective `generate` cannot take).
        `first_turns_together`: the first turns go through `engine.generate` (with several ranks sampling apart, a
        collective they would not all reach)."""
        return run_episodes(
            engine,
            envs,
            prompts,
            params,
            seeds,
            decode=lambda ids: self.turn_text(tokenizer, ids),
            encode_observation=encode_observation,
            reward_names=self.env_reward_names,
            max_turns=self.max_turns,
            max_total_tokens=self.max_total_tokens,
            pad_id=tokenizer.pad_token_id,
            device=device,
            runner=self.runner,
            any_active=any_active,
            ended=frozenset(ended),
            concurrent_generate=independent_generate(engine, self.independent_turns and concurrent),
            first_turns_together=first_turns_together,
            ready_batches=self.ready_batches and single_caller,
            stop_ids=self.stop_ids(),
        )

    def stop_ids(self) -> frozenset[int]:
        """The ids that end a model turn: the tokenizer's EOS and the model's generation-config EOS ids (the
        engines stop on the same)."""
        if self._stop_ids is None:
            self._stop_ids = frozenset(model_eos_token_ids(self.host.policy, self.host.tokenizer.eos_token_id))
        return self._stop_ids

    def turn_text(self, tokenizer: Any, ids: list[int]) -> str:
        """A model turn as the environment's `step` reads it: decoded without its special tokens, or with them
        (`raw_turns`: a `response_template`'s markup, Gemma 4's `<|tool_call>`, may be special tokens)."""
        return tokenizer.decode(ids, skip_special_tokens=not self.raw_turns)

    def start_episodes(self, rows: list[dict[str, Any]]) -> tuple[list[Any], list[Any], Optional[str], set[int]]:
        """An environment per row (the row picks it, with several by name), each reset with its row at once
        (`runner`): the environments, each episode's prompt (its first observation, or its row's prompt), the first
        reset error (to raise on every rank together, after the episodes' collectives) and the episodes whose reset
        failed."""
        envs = [self.env_factory(row) for row in rows]
        firsts = self.runner.run([(env.reset, (row,)) for env, row in zip(envs, rows)])
        prompts, error, ended = [], None, set()
        for index, (row, first) in enumerate(zip(rows, firsts)):
            if isinstance(first, BaseException):
                failure = f"raised {exception_line(first)}"
                if isinstance(first, EnvCallTimeout):
                    failure = f"{first} (model.env.step_timeout_s)"
                error = error or f"{env_label(envs[index])}.reset {failure}"
                first = None
                ended.add(index)  # never stepped: its environment may still be busy in that reset
            elif isinstance(first, TokenIds) and len(first) > (self.prompts.max_length or len(first)):
                error = error or (
                    f"{env_label(envs[index])}.reset gave a prompt of {len(first)} tokens, more than "
                    f"model.sampling.max_prompt_length ({self.prompts.max_length}): raise it (its world rendered it "
                    "whole)"
                )
                if isinstance(envs[index], ClosesEpisode):  # not busy: released now, never stepped
                    self.runner.run([(envs[index].close, ())])
                first = None
                ended.add(index)
            prompts.append(row["prompt"] if first is None else first)
        if self.tool_schemas is not None:  # the tools' schemas reach the model through its chat template
            prompts = [chat_prompt(p) for p in prompts]
        return envs, prompts, error, ended

    def encode_prompts(
        self, rows: list[dict[str, Any]], prompts: list[Any], device: Optional[torch.device]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The episodes' prompts (`start_episodes`'s, one per row of `rows`) rendered with the tools' schemas (each
        with its environment's, with several by name) and tokenised, on `device` (`PromptEncoder.encode`)."""
        if self.routing is None:
            return self.prompts.encode(prompts, self.tool_schemas, device=device)
        return self.prompts.encode(prompts, per_prompt_tools=self.routing.prompt_tools(rows), device=device)

    def encode_observation(self, observation: Any, turn_ids: list[int]) -> list[int]:
        """An observation's ids (`ObservationEncoder`) with the module's tokenizer."""
        if self._observations is None:
            self._observations = ObservationEncoder(self.host.tokenizer, self.tool_schemas)
        return self._observations.encode(observation, turn_ids)

    def close(self) -> None:
        self.runner.close()
        super().close()

    def _any_rank_active(self, active: bool) -> bool:
        """Whether any rank still has episodes running (every rank calls it once per turn)."""
        if self.host.trainer.world_size == 1:
            return active
        flag = torch.tensor(float(active), device=self.host.device)
        return bool(reduce_across_ranks(flag) > 0)


def episodes_start_failure(err: Exception) -> str:
    """The one line of a generation whose episodes could not start: an environment's constructor or the chat
    template raised `err` (its first line kept)."""
    message = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"model.env: the episodes could not start: {type(err).__name__}: {message}"


def trl_reward_inputs(
    rows: list[dict[str, Any]], prompts: list[Any], envs: list[Any], unfinished: frozenset[int]
) -> tuple[list[dict[str, Any]], list[Any]]:
    """What reward functions get after TRL environment classes' episodes, as in TRL: each episode's row with its
    prompt (with what `reset` appended), and the user's instances (`environments=`), None for one whose environment
    failed or is still busy in an overrunning call."""
    episode_rows = [{**row, "prompt": prompt} for row, prompt in zip(rows, prompts)]
    instances = [None if i in unfinished else env.instance for i, env in enumerate(envs)]
    return episode_rows, instances


def independent_generate(engine: Any, allowed: bool) -> Optional[Callable[..., RolloutOutput]]:
    """What independent episodes submit their turns to (`lit_rl.rollout.multi_turn.run_episodes`): the engine's
    `concurrent_generate` (a `generate` many threads may call at once), when `allowed` (`model.env.independent_turns`
    and no other rank takes part in the engine's calls) and the engine has one; None: turn by turn."""
    return engine.concurrent_generate if allowed and isinstance(engine, ConcurrentEngine) else None


class ObservationEncoder:
    """An observation's ids: chat messages rendered by the chat template after the turn (`ChatRenderer`), text
    encoded as it is, `TokenIds` as they are. Special tokens' text in the first two (a tool echoing
    "<|endoftext|>") stays text."""

    def __init__(self, tokenizer: Any, tool_schemas: Optional[list[dict[str, Any]]]) -> None:
        self.tokenizer, self.tool_schemas = tokenizer, tool_schemas
        self._chat: Optional[ChatRenderer] = None

    def encode(self, observation: Any, turn_ids: list[int]) -> list[int]:
        if isinstance(observation, TokenIds):  # a `TokenEnvironment`'s, rendered by its world
            return list(observation)
        if isinstance(observation, list):
            if self._chat is None:
                self._chat = ChatRenderer(self.tokenizer, self.tool_schemas)
            return self._chat.observation_ids(observation, turn_ids)
        return self.tokenizer.encode(str(observation), add_special_tokens=False, split_special_tokens=True)


class SampledAhead:
    """What the asynchronous producers share (mixed in before a producer class): the generations launched ahead
    (`in_flight`), each sampled by the policy version `generation_version` gives it, kept by checkpoints."""

    in_flight: AsyncGenerations
    steps_per_generation: int
    max_staleness: int

    def launched_version(self, generation: int) -> int:
        """v(g) of a generation launched now: the trainer must be at that step."""
        version = generation_version(generation, self.steps_per_generation, self.max_staleness)
        if version != self.host.trainer.global_step:
            raise RuntimeError(
                f"asynchronous rollouts: generation {generation} must be sampled by policy version {version}, "
                f"but the trainer is at step {self.host.trainer.global_step}"
            )
        return version

    def take_to_device(self, generation: int) -> PendingGeneration:
        """The launched `generation`, finished (waiting for it: the part of its sampling the training did not hide,
        timed as `generation`), its tensors moved to the module's device."""
        with self.host.timer.phase("generation"):
            sampled = self.in_flight.take(self.engines.built, generation)
        device = self.host.device
        sampled.prompt_ids, sampled.prompt_mask = sampled.prompt_ids.to(device), sampled.prompt_mask.to(device)
        sampled.output = RolloutOutput(*(None if t is None else t.to(device) for t in vars(sampled.output).values()))
        for name in ("env_rewards", "reward_components", "rewards"):
            if getattr(sampled, name) is not None:
                setattr(sampled, name, getattr(sampled, name).to(device))
        return sampled

    def engine_for_launch(self) -> Any:
        """The engine, to stage a version on: it will load the staged versions, so a sampling by the current
        weights (`sample`) must push them again."""
        self.engines.weights_replaced()
        return self.engines.started()

    def sample(
        self, rows: list[dict[str, Any]], repeat: int, params: SamplingParams, seeds: Optional[list[int]] = None
    ) -> ScoredCompletions:
        """Completions sampled now by the current weights (validation, dynamic sampling's refills): the
        generations in flight finish first with their own versions (a wait for the engine, timed as generation),
        then the engine takes the current weights."""
        with self.host.timer.phase("generation"):
            self.before_validation()
        return super().sample(rows, repeat, params, seeds)

    def before_validation(self) -> None:
        # Sampling now pushes the current weights: first let the generations in flight finish with their versions.
        if self.engines.built is not None:
            self.in_flight.wait_all(self.engines.built)
            self.in_flight.forget_staged()

    def state_dict(self) -> list[dict[str, Any]]:
        """This rank's launched generations, finished (waiting for those in flight): the weights they were
        sampled with are not in the checkpoint, so they could not be sampled again."""
        return self.in_flight.state_dict(self.engines.built)

    def load_state_dict(self, state: Optional[list[dict[str, Any]]]) -> None:
        self.in_flight.load_state_dict(state or [])

    def close(self) -> None:
        self.in_flight = AsyncGenerations()  # generations in flight are abandoned with the engine
        super().close()


class AsyncProducer(SampledAhead, RolloutProducer):
    """Generations launched ahead of the trainer and sampled in the background with a fixed lag
    (`lit_rl.rollout.asynchronous`): `launch(g, rows)` when the loader says so, `generation(g)` takes g finished.

    Args:
        steps_per_generation: m = `steps_per_generation x num_iterations`, the optimizer steps taken on one
            generation.
        max_staleness: k = `model.rollout.max_staleness`.
        parts: `ProducerParts`.
    """

    def __init__(self, parts: ProducerParts, *, steps_per_generation: int, max_staleness: int) -> None:
        super().__init__(parts)
        self.steps_per_generation = steps_per_generation
        self.max_staleness = max_staleness
        self.in_flight = AsyncGenerations()

    def launch(self, generation: int, rows: list[dict[str, Any]]) -> None:
        """Start sampling `generation` in the background with the current weights, which must be those of its
        version v(g)."""
        host = self.host
        version = self.launched_version(generation)
        prompt_ids, prompt_mask = self.prompts.encode([row["prompt"] for row in rows], device=self.host.device)
        engine = self.engine_for_launch()
        with host.timer.phase("weight_push"):  # staging the weights, when this version is new
            self.in_flight.launch(
                engine,
                generation,
                version,
                prompt_ids,
                prompt_mask,
                self.params,
                self.completion_seeds(len(rows), generation),
                self.engines.weight_stream,
            )

    def generation(
        self, generation: int, rows: list[dict[str, Any]], refills: Optional[list[list[dict[str, Any]]]] = None
    ) -> ScoredCompletions:
        """The launched `generation`, finished (`take_to_device`), scored now."""
        sampled = self.take_to_device(generation)
        out = sampled.output
        self.host.timer.count("generated_tokens", float(out.completion_mask.sum()))
        return self.scored(rows, 1, sampled.prompt_ids, sampled.prompt_mask, out, version=sampled.version)
