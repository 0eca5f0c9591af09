"""The rollout machinery that GRPO, RLOO and Online DPO share: a thin base, their losses live in their files.

One `training_step` is one micro-step of a fixed schedule (see `lit_rl.data.schedule`): a generation fills a
buffer of B*G completions per rank; then `num_iterations` passes over it, each `steps_per_generation` optimizer
steps of `accumulate_grad_batches` micro-batches of `micro_batch_size` completions. Lightning's automatic
optimization does the accumulation, clipping, precision and `global_step`, so checkpoint cadence cannot drift.

With `micro_batch_tokens`, each optimizer step's completions are grouped into micro-batches by tokens instead of
by count (`lit_rl.training.micro_batches`); the micro-steps per optimizer step, and so the schedule, stay the same. On
more than one rank the step's completions are first dealt so that the ranks' token totals even out
(`lit_rl.training.rank_balance`).

A subclass provides `finish_rollout` (advantages, or pairs), `micro_batch_loss` and its metric collection.

With `max_staleness = k > 0` the generations are sampled ahead, in the background, by `lit_rl.rollout.producer`
(the schedule, the staleness contract and what a checkpoint keeps are described there): the module launches them
when the loader says so, and takes each when its first micro-step comes; the old log-probs are then the current
policy's, and the rollout correction weighs them against the engine's.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
from torchmetrics import MetricCollection

from lit_rl.algorithms.base import PolicyModule
from lit_rl.algorithms.engines import RolloutEngineOwner
from lit_rl.algorithms.episodes import EpisodeRunner
from lit_rl.algorithms.micro_steps import MicroBatcher
from lit_rl.algorithms.reward_scoring import RewardScorer
from lit_rl.algorithms.rng import rng_state, set_rng_state
from lit_rl.algorithms.rollout_checks import check_prompt_lengths
from lit_rl.config import EnvArgs, OptimArgs, PolicyArgs, RewardArgs, RolloutArgs, SamplingArgs, ScheduleArgs, as_args
from lit_rl.data.schedule import RolloutSchedule
from lit_rl.errors import ConfigError, EnvironmentStepError, RewardFunctionError
from lit_rl.losses import LossNormalizer
from lit_rl.ops import kl_k3
from lit_rl.rewards import TrainerState
from lit_rl.rollout import RolloutEngine, RolloutOutput, SamplingParams
from lit_rl.rollout.base import global_batch_seeds
from lit_rl.rollout.producer import AsyncRolloutProducer, generation_version, generations_launched_at
from lit_rl.training.metrics import (
    asynchronous_rollout_metrics,
    episode_metrics,
    rollout_eval_metrics,
    token_budget_metrics,
    update_rollout_metrics,
)
from lit_rl.training.strategies import fail_on_every_rank, is_accumulating_micro_batch
from lit_rl.types import RolloutBatch, model_token_mask

ZERO_STD = 1e-6


def group_reward_std(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Each row's group's reward std [N] (groups of `group_size` consecutive rows); 0 for groups of one."""
    if group_size == 1:
        return torch.zeros_like(rewards)
    return rewards.view(-1, group_size).std(dim=1).repeat_interleave(group_size)


class OnPolicyModule(RolloutEngineOwner, EpisodeRunner, PolicyModule):
    """Base of algorithms that learn from their own samples. Not used directly: see GRPO, RLOO, OnlineDPO."""

    # Consecutive completions the loss reads together (Online DPO: a pair); token-budget micro-batches keep them.
    micro_batch_unit = 1

    def __init__(
        self,
        policy: Optional[PolicyArgs],
        optim: Optional[OptimArgs],
        schedule: Optional[ScheduleArgs],
        sampling: Optional[SamplingArgs],
        rewards: Optional[RewardArgs],
        env: Optional[EnvArgs],
        rollout: Optional[RolloutArgs],
        *,
        min_generations: int = 2,
    ) -> None:
        """The groups of `lit_rl.config` (None: their defaults), the engine and the asynchrony among them
        (`rollout`); `min_generations`: 2 where completions of a prompt are compared, 1 where a critic is the
        baseline."""
        self.schedule_args = schedule = as_args(ScheduleArgs, schedule)
        self.sampling_args = sampling = as_args(SamplingArgs, sampling)
        self.reward_args = rewards = as_args(RewardArgs, rewards)
        self.env_args = env = as_args(EnvArgs, env)
        self.rollout_args = rollout = as_args(RolloutArgs, rollout)
        schedule.check()
        sampling.check(min_generations)
        rewards.check()
        env.check()
        rollout.check()
        rollout.check_taken_by(type(self).__name__, frozenset(self.rollout_options))
        if rollout.max_staleness > 0 and env.enabled:
            raise ConfigError(
                "model.env.environment (or model.env.tools) with model.rollout.max_staleness > 0 is not supported "
                "yet: asynchronous rollouts sample single completions in the background"
            )
        super().__init__(policy, optim, max_prompt_length=sampling.max_prompt_length)
        self.reward_scorer = RewardScorer(rewards)  # a plain object: the reward functions and their weights
        self.engine_config = rollout.engine_config
        self.vllm_config = self.engine_config.vllm  # lit-rl's vLLM engines' settings; None for any other engine
        self.rollout_engine: Optional[RolloutEngine] = None  # a plain object, never an nn.Module attribute
        self._engine_weights_step: Optional[int] = None  # the global_step whose weights the engine holds
        self._micro_steps_done = 0
        self._buffer: Optional[RolloutBatch] = None
        self._normalizers: list[LossNormalizer] = []
        self.max_staleness = rollout.max_staleness
        self._producer = AsyncRolloutProducer() if rollout.max_staleness > 0 else None
        self.setup_environment(env)

    @property
    def micro_batch_tokens(self) -> Optional[int]:
        """`model.schedule.micro_batch_tokens`: micro-batches cut by tokens (None: by count)."""
        return self.schedule_args.micro_batch_tokens

    @property
    def micro_batcher(self) -> MicroBatcher:
        """How the buffer is cut into micro-steps (built on use: the accumulation is the trainer's)."""
        schedule = self.schedule_args
        return MicroBatcher(
            schedule.micro_batch_size, self.accumulate, schedule.micro_batch_tokens, self.micro_batch_unit
        )

    def gather_stacked(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor`, stacked: [world, ...] (also with one rank)."""
        return self.all_gather(tensor).reshape(self.trainer.world_size, *tensor.shape)

    # -- what subclasses decide ------------------------------------------------------------------------------
    train_metrics: MetricCollection  # set by the subclass, with `val_metrics = self.rollout_val_metrics()`
    val_metrics: MetricCollection

    def rollout_train_metrics(self, metrics: MetricCollection) -> MetricCollection:
        """The algorithm's training collection, with the staleness metrics of asynchronous rollouts, as `train/`."""
        if self.max_staleness > 0:
            metrics.add_metrics(asynchronous_rollout_metrics())
        if self.micro_batch_tokens is not None:
            metrics.add_metrics(token_budget_metrics())
        if self.env_factory is not None:
            metrics.add_metrics(episode_metrics())
        return metrics.clone(prefix="train/")

    def rollout_val_metrics(self) -> MetricCollection:
        """Validation metrics of generating for held-out prompts, one per reward column (and the episodes')."""
        metrics = rollout_eval_metrics(self.reward_names)
        if self.env_factory is not None:
            metrics.add_metrics(episode_metrics())
        return metrics.clone(prefix="val/")

    def uses_reference(self) -> bool:
        """Whether a frozen reference model is loaded (its log-probs land in `RolloutBatch.ref_logprobs`)."""
        return False

    def needs_old_logprobs(self) -> bool:
        """Whether the policy's log-probs at generation time are computed (else the first pass reuses its own)."""
        schedule = self.schedule_args
        return schedule.num_iterations > 1 or schedule.steps_per_generation > 1 or self.max_staleness > 0

    def shape_rewards(self, rewards: torch.Tensor, out: RolloutOutput) -> torch.Tensor:
        """The rewards [N] advantages are computed from, given this rank's completions (default: unchanged)."""
        return rewards

    def loss_mask(self, batch: RolloutBatch) -> torch.Tensor:
        """[N, T]: the tokens the loss and its denominators count (default: every token the model sampled)."""
        return model_token_mask(batch)

    def finish_rollout(self, batch: RolloutBatch, all_rewards: torch.Tensor) -> None:
        """Fill `batch.advantages` (and any algorithm field) from every rank's rewards `all_rewards` [world*N]."""
        raise NotImplementedError

    def micro_batch_loss(
        self, mb: RolloutBatch, logprobs: torch.Tensor, normalizer: LossNormalizer
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The micro-batch's share of the step loss (denominators from `normalizer`) and per-token stats."""
        raise NotImplementedError

    def update_algorithm_metrics(self, mb: RolloutBatch, loss: torch.Tensor, stats: dict[str, torch.Tensor]) -> None:
        """Update the algorithm's own training metrics for this micro-batch."""

    # -- set-up ----------------------------------------------------------------------------------------------
    def configure_model(self) -> None:
        super().configure_model()
        if self.uses_reference() and self.ref_model is None and not self.reference_is_adapter_off():
            self.ref_model = self.load_reference()

    def teardown(self, stage: str) -> None:
        if self._producer is not None:
            self._producer = AsyncRolloutProducer()  # generations in flight are abandoned with the engine
        if self.rollout_engine is not None:
            self.rollout_engine.close()
            self.rollout_engine = None

    def setup(self, stage: str) -> None:
        if self.engine_config.colocated:
            self.engine_placement()  # rejects a TP size that does not fit the ranks, before anything starts
        if stage != "fit":
            return
        limit = self.trainer.limit_train_batches
        if isinstance(limit, int) or limit != 1.0:
            # A truncated epoch would end inside a generation, where Lightning forces a partial optimizer step.
            if not isinstance(limit, int) or limit % self.micro_steps_per_generation != 0:
                raise ConfigError(
                    f"trainer.limit_train_batches={limit} must be an integer multiple of the "
                    f"{self.micro_steps_per_generation} micro-steps of a generation"
                )
        completions = self.completions_per_generation * self.trainer.world_size
        G = self.sampling_args.num_generations
        if completions % G != 0:
            raise ConfigError(
                "model.schedule.micro_batch_size x trainer.accumulate_grad_batches x model.schedule."
                f"steps_per_generation x ranks = {completions} completions per generation must be a multiple of "
                f"model.sampling.num_generations={G} (a group may span ranks, but every group must be whole)"
            )

    def on_fit_start(self) -> None:
        check_prompt_lengths(self)

    @property
    def accumulate(self) -> int:
        return self.trainer.accumulate_grad_batches

    @property
    def completions_per_generation(self) -> int:
        """Completions one rank generates at a time: B*G = micro_batch_size x accumulation x steps_per_generation."""
        return self.schedule_args.micro_batch_size * self.accumulate * self.schedule_args.steps_per_generation

    @property
    def micro_steps_per_generation(self) -> int:
        micro_batches = self.completions_per_generation // self.schedule_args.micro_batch_size
        return micro_batches * self.schedule_args.num_iterations

    def rollout_schedule(self) -> RolloutSchedule:
        """How the training loader must feed this module (see `lit_rl.data.schedule`)."""
        launches = None
        if self.max_staleness > 0:
            m, k = self.optimizer_steps_per_generation, self.max_staleness
            launches = lambda step: generations_launched_at(step, m, k)  # noqa: E731
        return RolloutSchedule(
            completions_per_rank=self.completions_per_generation,
            group_size=self.sampling_args.num_generations,
            micro_steps_per_generation=self.micro_steps_per_generation,
            start_micro_step=lambda: self._micro_steps_done,
            micro_steps_per_optimizer_step=self.accumulate,
            launches=launches,
            refill_generations=self.refill_generations,
        )

    refill_generations = 0  # the refill generations the loader offers (GRPO's dynamic sampling sets it)
    rollout_options: tuple[str, ...] = ()  # the GRPO-only rollout options (`GRPO_ROLLOUT_OPTIONS`) this one takes

    @property
    def optimizer_steps_per_generation(self) -> int:
        """m = steps_per_generation x num_iterations: the optimizer steps taken on one generation."""
        return self.schedule_args.steps_per_generation * self.schedule_args.num_iterations

    # -- rollout ---------------------------------------------------------------------------------------------
    def sampling_params(self, training: bool) -> SamplingParams:
        sampling = self.sampling_args
        return SamplingParams(
            max_new_tokens=sampling.max_new_tokens,
            min_new_tokens=sampling.min_new_tokens,
            temperature=sampling.temperature if training else sampling.val_temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
        )

    def score_output(
        self, rows: list[dict[str, Any]], out: RolloutOutput, repeat: int, env_rewards: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Reward components [N, F] and rewards [N] of an engine's completions of `rows` x `repeat`
        (`RewardScorer.score`), failing on every rank together when they fail on one."""
        completions = self.tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
        # TRL's `completion_ids`: each completion's tokens up to and including its EOS, without the padding.
        lengths = (out.completion_mask > 0).sum(dim=1).tolist()
        completion_ids = [ids[:n] for ids, n in zip(out.completion_ids.tolist(), lengths)]
        trainer = self.trainer
        state = TrainerState(trainer.global_step, trainer.max_steps, float(trainer.current_epoch))
        error: Optional[RewardFunctionError] = None
        components = rewards = None
        with self.timer.phase("reward"):
            try:
                components, rewards = self.reward_scorer.score(
                    rows, completions, completion_ids, repeat, self.device, state, self.reward_names, env_rewards
                )
            except RewardFunctionError as err:
                error = err
            elsewhere = "a reward function failed on another rank (its error is above)"
            self.fail_on_every_rank(error, RewardFunctionError, elsewhere)
        return components, rewards

    def fail_on_every_rank(self, error: Optional[Exception | str], kind: type[Exception], elsewhere: str) -> None:
        """`lit_rl.training.strategies.fail_on_every_rank` over this module's ranks."""
        fail_on_every_rank(error, kind, elsewhere, self.trainer.world_size, self.trainer.global_rank, self.device)

    def sample(
        self, rows: list[dict[str, Any]], repeat: int, params: SamplingParams, seeds: Optional[list[int]] = None
    ):
        """For `rows` x `repeat`: prompt ids [N, P], mask, engine output, reward components [N, F] and rewards [N]
        (sampled with one seed per completion when `seeds` are given, else from the global RNG). With an
        environment each completion is an episode's transcript (`EpisodeRunner.sample_episodes`)."""
        if self.env_factory is not None:
            with self.timer.phase("generation"):
                prompt_ids, prompt_mask, episodes = self.sample_episodes(rows, repeat, params, seeds)
            self.fail_on_every_rank(episodes.error, EnvironmentStepError, "the environment failed on another rank")
            out = episodes.output
            self.timer.count("generated_tokens", float(model_token_mask(out).sum()))
            components, rewards = self.score_output(rows, out, repeat, episodes.env_rewards)
            return prompt_ids, prompt_mask, out, components, rewards
        prompt_ids, prompt_mask = self.encode_prompts([row["prompt"] for row in rows])
        prompt_ids = prompt_ids.repeat_interleave(repeat, dim=0)  # [B*G, P]
        prompt_mask = prompt_mask.repeat_interleave(repeat, dim=0)
        engine = self.engine()  # pushes the policy's weights first when the engine needs them (its own phase)
        with self.timer.phase("generation"):
            out = engine.generate(prompt_ids, prompt_mask, params, seeds=seeds)
        self.timer.count("generated_tokens", float(out.completion_mask.sum()))
        components, rewards = self.score_output(rows, out, repeat)
        return prompt_ids, prompt_mask, out, components, rewards

    def sample_generation(self, rows: list[dict[str, Any]], refills: list[list[dict[str, Any]]]):
        """This rank's completions of the current generation, as `sample` returns them (`refills`: the prompt rows
        of the refill generations the loader offers, for algorithms that sample more when a batch falls short)."""
        return self.sample(rows, 1, self.sampling_params(training=True), self.completion_seeds(len(rows)))

    @torch.no_grad()
    def make_rollout(
        self,
        rows: list[dict[str, Any]],
        sampled: Optional[Any] = None,
        refills: Optional[list[list[dict[str, Any]]]] = None,
    ) -> RolloutBatch:
        """Generate and score this rank's completions (`rows`: the prompt row of each, see
        `lit_rl.data.schedule`), then let the algorithm finish the batch. `sampled`: a generation the producer
        made ahead (`PendingGeneration`), scored here instead of sampling."""
        G = self.sampling_args.num_generations
        if sampled is None:
            prompt_ids, prompt_mask, out, components, rewards = self.sample_generation(rows, refills or [])
            version = self.trainer.global_step
        else:
            prompt_ids, prompt_mask = sampled.prompt_ids.to(self.device), sampled.prompt_mask.to(self.device)
            out = RolloutOutput(*(None if t is None else t.to(self.device) for t in vars(sampled.output).values()))
            self.timer.count("generated_tokens", float(out.completion_mask.sum()))
            components, rewards = self.score_output(rows, out, 1)
            version = sampled.version
        rewards = self.shape_rewards(rewards, out)
        self.release_engine()  # sleep mode: the log-prob forwards and the update get the engine's memory
        # Every rank's rewards in global slot order: a group may span ranks, so group statistics use them all.
        all_rewards = self.all_gather(rewards).reshape(-1)  # [world*N]
        group_std = group_reward_std(all_rewards, G)[self.local_slice(len(rows))]
        batch = RolloutBatch(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=out.completion_ids,
            completion_mask=out.completion_mask,
            rollout_logprobs=out.logprobs,
            rewards=rewards,
            reward_components=components,
            advantages=torch.zeros_like(rewards),
            group_reward_std=group_std,
            policy_version=torch.full_like(rewards, version, dtype=torch.long),
            sampled_mask=out.sampled_mask,
            episode_stats=out.episode_stats,
        )
        if self.needs_old_logprobs():
            with self.timer.phase("old_logprobs"):
                batch.old_logprobs = self._logprobs_in_chunks(self.policy, batch)
        if self.uses_reference():
            with self.timer.phase("ref_logprobs"), self.reference_model() as ref_model:
                batch.ref_logprobs = self._logprobs_in_chunks(ref_model, batch)
        self.finish_rollout(batch, all_rewards)
        world_size, batcher = self.trainer.world_size, self.micro_batcher
        loss_tokens = self.loss_mask(batch).sum(dim=1)  # [N]
        self._normalizers = batcher.step_normalizers(batch, loss_tokens, self.completion_budget, world_size)
        if self.micro_batch_tokens is not None and world_size > 1:
            pad = self.tokenizer.pad_token_id
            batch = batcher.balanced_across_ranks(batch, self.gather_stacked, world_size, self.global_rank, pad)
        return batch

    def completion_seeds(self, n: int, generation: Optional[int] = None) -> list[int]:
        """Sampling seeds of this rank's `n` completions of `generation` (default: the current one): slices of one
        list for the global batch (`global_batch_seeds`), so that a completion's sample depends on the run's seed, the
        generation and its place in the global batch, never on how the batch is split across ranks. The loader
        gives each rank a consecutive slice of the generation's prompts, so rank r holds completions r*n..r*n+n-1.
        """
        if generation is None:
            generation = self._micro_steps_done // self.micro_steps_per_generation
        run_seed = int(os.environ.get("PL_GLOBAL_SEED", 0))  # `seed_everything`'s seed, the same on every rank
        seeds = global_batch_seeds(run_seed, generation, n * self.trainer.world_size)
        return seeds[self.local_slice(n)]

    def local_slice(self, n: int) -> slice:
        """This rank's rows in a tensor gathered from all ranks with `n` rows each."""
        return slice(self.global_rank * n, (self.global_rank + 1) * n)

    def _logprobs_in_chunks(self, model: torch.nn.Module, batch: RolloutBatch) -> torch.Tensor:
        temperature = self.sampling_args.temperature
        return self.micro_batcher.per_micro_batch(
            batch,
            lambda mb: (
                self.score_completions(
                    model, mb.prompt_ids, mb.prompt_mask, mb.completion_ids, mb.completion_mask, temperature
                ).logprobs
            ),
        )

    # -- training --------------------------------------------------------------------------------------------
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        if batch["micro_step"] != self._micro_steps_done:
            raise RuntimeError(
                f"rollout schedule drifted: loader gave micro-step {batch['micro_step']}, "
                f"the module expected {self._micro_steps_done}"
            )
        generation, generation_micro_step = divmod(batch["micro_step"], self.micro_steps_per_generation)
        for launched, rows in batch.get("launch", ()):
            self.launch_generation(launched, rows)
        if generation_micro_step == 0:
            sampled = None
            if self._producer is not None:
                with self.timer.phase("generation"):  # the part of the generation the training did not hide
                    sampled = self._producer.take(self.rollout_engine, generation)
            self._buffer = self.make_rollout(batch["rows"], sampled, batch.get("refill"))
        micro_batches = self.micro_steps_per_generation // self.schedule_args.num_iterations
        index = generation_micro_step % micro_batches
        if self._buffer.prompt_ids.device != self.device:  # restored from a checkpoint on CPU
            self._buffer = self._buffer.to(self.device)
        mb, has_completions = self.micro_batcher.micro_batch(self._buffer, index)

        self.timer.count("trained_tokens", float(mb.completion_mask.sum()))
        scores = self.score_completions(
            self.policy,
            mb.prompt_ids,
            mb.prompt_mask,
            mb.completion_ids,
            mb.completion_mask,
            self.sampling_args.temperature,
            extras=("entropy",),
        )
        logprobs = scores.logprobs  # [n, T]
        loss, stats = self.micro_batch_loss(mb, logprobs, self._normalizers[index // self.accumulate])
        if has_completions:
            if self.micro_batch_tokens is not None:
                self.train_metrics["micro_batch_tokens/max"].update(mb.prompt_mask.sum() + mb.completion_mask.sum())
            first_pass = generation_micro_step < micro_batches
            self._update_common_metrics(mb, scores.entropy, logprobs if first_pass else None)
            self.update_algorithm_metrics(mb, loss, stats)
        if self.micro_batch_tokens is not None and index % self.accumulate == 0:  # the step's first micro-step
            # The tokens of this rank's rows of the step, into the per-step max and min (synced over ranks: the
            # most and the fewest any rank trained on).
            tokens = self.micro_batcher.step_tokens(self._buffer, index // self.accumulate)
            self.train_metrics["rank_tokens/max"].update(tokens)
            self.train_metrics["rank_tokens/min"].update(tokens)
        self._micro_steps_done += 1
        # The loss denominators cover the whole step on every rank.
        return loss * self.step_loss_scale()

    def launch_generation(self, generation: int, rows: list[dict[str, Any]]) -> None:
        """Start sampling `generation` in the background with the current weights (asynchronous rollouts)."""
        version = generation_version(generation, self.optimizer_steps_per_generation, self.max_staleness)
        if version != self.trainer.global_step:
            raise RuntimeError(
                f"asynchronous rollouts: generation {generation} must be sampled by policy version {version}, "
                f"but the trainer is at step {self.trainer.global_step}"
            )
        prompt_ids, prompt_mask = self.encode_prompts([row["prompt"] for row in rows])
        if self.rollout_engine is None:
            with self.timer.phase("engine_start"):
                self.rollout_engine = self.build_engine()
        engine = self.rollout_engine
        with self.timer.phase("weight_push"):  # staging the weights, when this version is new
            self._producer.launch(
                engine,
                generation,
                version,
                prompt_ids,
                prompt_mask,
                self.sampling_params(training=True),
                self.completion_seeds(len(rows), generation),
                self.weight_stream,
            )

    def on_validation_start(self) -> None:
        # Validation samples with the engine too (pushing the current weights): first let the generations in
        # flight finish with the versions they were launched with.
        if self._producer is not None and self.rollout_engine is not None:
            self._producer.wait_all(self.rollout_engine)
            self._producer.forget_staged()

    def _update_common_metrics(
        self, mb: RolloutBatch, entropy: torch.Tensor, fresh_logprobs: Optional[torch.Tensor]
    ) -> None:
        m = self.train_metrics
        model_tokens = model_token_mask(mb)
        tokens = model_tokens > 0  # [n, T]: observation tokens count in no token metric
        if self.max_staleness > 0:
            staleness = (self.trainer.global_step - mb.policy_version).float()  # [n] optimizer steps
            m["staleness/mean"].update(staleness)
            m["staleness/max"].update(staleness)
        components = mb.reward_components
        update_rollout_metrics(m, self.reward_names, mb.rewards, components, model_tokens, mb.group_reward_std)
        self.update_episode_metrics(m, mb.episode_stats)
        m["entropy"].update(entropy[tokens])
        # Compare the engine's log-probs with the trainer's at the same weights: the old log-probs when they
        # were computed at generation time, else this (first, on-policy) pass.
        trainer_logprobs = mb.old_logprobs if mb.old_logprobs is not None else fresh_logprobs
        if trainer_logprobs is not None:
            log_ratio = (trainer_logprobs.detach() - mb.rollout_logprobs)[tokens]
            m["rollout_logprob_diff/mean"].update(log_ratio.abs())
            m["rollout_logprob_diff/max"].update(log_ratio.abs())
            m["rollout_kl"].update(kl_k3(mb.rollout_logprobs[tokens], trainer_logprobs.detach()[tokens]))
            ratio = torch.exp(log_ratio)
            for stat in ("min", "mean", "max"):
                m[f"rollout_is_ratio/{stat}"].update(ratio)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Once per optimizer step, after every micro-batch of the window has run its backward.
        if is_accumulating_micro_batch(self.trainer):
            return
        self.log_collection(self.train_metrics, on_step=True, prog_bar=("reward", "loss"))
        self.log_timings()

    # -- validation ------------------------------------------------------------------------------------------
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        G = self.sampling_args.val_num_generations
        # Validation samples with its own RNG stream, so it cannot change what training samples next.
        # fork_rng saves and restores the CPU RNG and, listed here, this GPU's.
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(7919 * (batch_idx + 1))
            _, _, out, components, rewards = self.sample(batch["rows"], G, self.sampling_params(training=False))
        group_std = group_reward_std(rewards, G)
        weight = batch["weight"].to(rewards).repeat_interleave(G)  # 0 on rows that pad this rank's share
        model_tokens = model_token_mask(out)
        names = self.reward_names
        update_rollout_metrics(self.val_metrics, names, rewards, components, model_tokens, group_std, weight)
        self.update_episode_metrics(self.val_metrics, out.episode_stats, weight)

    def on_validation_epoch_end(self) -> None:
        self.release_engine()  # after the last validation batch: all of them share one push
        self.log_collection(self.val_metrics, on_step=False, prog_bar=("reward",))

    # -- checkpoints -----------------------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)  # without the reference model
        # Every rank has its own buffer and RNG stream, but only rank 0 writes the file: gather them all.
        local = {
            "buffer": None if self._buffer is None else self._buffer.state_dict(),
            "normalizers": [vars(n) for n in self._normalizers],
            "rng": rng_state(self.device),
            # Generations launched ahead, finished (waited for): their weights are not in the checkpoint.
            "pending": None if self._producer is None else self._producer.state_dict(self.rollout_engine),
        }
        per_rank = [local]
        if self.trainer.world_size > 1:
            per_rank = [None] * self.trainer.world_size
            torch.distributed.all_gather_object(per_rank, local)
        checkpoint["lit_rl"] = {"micro_steps_done": self._micro_steps_done, "per_rank": per_rank}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        state = checkpoint.get("lit_rl")
        if state is None:
            return
        per_rank = state["per_rank"]
        if len(per_rank) != self.trainer.world_size:
            raise ConfigError(
                f"checkpoint was written by {len(per_rank)} ranks, this run has {self.trainer.world_size}: "
                "rollout algorithms resume their buffer per rank, so resume with the same number of devices"
            )
        mine = per_rank[self.global_rank]
        self._micro_steps_done = state["micro_steps_done"]
        # Kept on CPU here: the module is moved to its device after this hook; training_step moves it.
        self._buffer = None if mine["buffer"] is None else RolloutBatch.from_state_dict(mine["buffer"])
        self._normalizers = [LossNormalizer(**n) for n in mine["normalizers"]]
        set_rng_state(mine["rng"])
        if self._producer is not None:
            self._producer.load_state_dict(mine.get("pending") or [])
