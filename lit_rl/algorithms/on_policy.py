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

The completions come from the module's producer (`lit_rl.rollout.producer`, chosen by `lit_rl.rollout.choice`),
which owns the engine, the reward scoring and the environments: the module asks it for generation g at the
generation's first micro-step. With `max_staleness = k > 0` the producer samples generations ahead, in the
background (`lit_rl.rollout.asynchronous`: the schedule, the staleness contract and what a checkpoint keeps): the
module launches them when the loader says so; the old log-probs are then the current policy's, and the rollout
correction weighs them against the engine's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import lightning as L
import torch
from torchmetrics import MetricCollection

from lit_rl.algorithms.micro_steps import MicroBatcher
from lit_rl.algorithms.rollout_checks import check_prompt_lengths
from lit_rl.algorithms.rollout_state import RolloutState
from lit_rl.config import EnvArgs, OptimArgs, PolicyArgs, RewardArgs, RolloutArgs, SamplingArgs, ScheduleArgs, as_args
from lit_rl.data.schedule import RolloutSchedule, ScheduledMicroStep
from lit_rl.errors import ConfigError
from lit_rl.losses import LossNormalizer, rollout_is_weights
from lit_rl.rewards.scorer import RewardScorer
from lit_rl.rollout import RolloutOutput, SamplingParams
from lit_rl.rollout.asynchronous import generations_launched_at
from lit_rl.rollout.choice import choose_producer
from lit_rl.rollout.engine_owner import EngineOwner
from lit_rl.rollout.producer import (
    GroupFilterStats,
    ProducerParts,
    RolloutProducer,
    ScoredCompletions,
    rank_slice,
)
from lit_rl.training.close_on_failure import ClosesRolloutsOnFailure
from lit_rl.training.metrics import (
    asynchronous_rollout_metrics,
    episode_metrics,
    rollout_correction_metrics,
    rollout_eval_metrics,
    token_budget_metrics,
    update_episode_metrics,
    update_on_policy_metrics,
    update_rollout_metrics,
)
from lit_rl.training.strategies import is_accumulating_micro_batch, reduce_across_ranks
from lit_rl.types import RolloutBatch, model_token_mask


@dataclass(frozen=True)
class MicroBatchTerms:
    """What the module computes for one micro-batch and gives `micro_batch_loss`, so that no hook asks back."""

    logprobs: torch.Tensor  # [n, T] this pass's log-probs of the completion tokens, with their gradient
    old_logprobs: torch.Tensor  # [n, T] the ratio's denominator (`OnPolicyModule.micro_batch_terms`), no gradient
    importance_weights: Optional[torch.Tensor]  # [n, T] the rollout correction's weights (None: no correction)


def group_reward_std(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Each row's group's reward std [N] (groups of `group_size` consecutive rows); 0 for groups of one."""
    if group_size == 1:
        return torch.zeros_like(rewards)
    return rewards.view(-1, group_size).std(dim=1).repeat_interleave(group_size)


class OnPolicyModule(RolloutState):
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
        sampling.check_engine(rollout.engine_config)
        rollout.check_taken_by(type(self).__name__, frozenset(self.rollout_options))
        super().__init__(policy, optim, max_prompt_length=sampling.max_prompt_length)
        self.engine_config = rollout.engine_config
        self.max_staleness = rollout.max_staleness
        self.in_flight_updates = rollout.in_flight_updates
        # The parts: plain objects, never nn.Module attributes nor hyperparameters.
        self.reward_scorer = RewardScorer(rewards)  # the reward functions and their weights
        self.engines = EngineOwner(self.engine_config, self)
        params, encoder = self.sampling_params(training=True), self.prompt_encoder
        parts = ProducerParts(self, self.engines, self.reward_scorer, params, encoder)
        # Where the rollouts come from (`lit_rl.rollout.choice`), and how the prompts are rendered (for the checks).
        choice = choose_producer(parts, env, rollout, self.tokenizer, self.optimizer_steps_per_generation)
        self.producer: RolloutProducer = choice.producer
        self.prompt_tools, self.prompt_routing = choice.prompt_tools, choice.prompt_routing
        # The most tokens one completion can hold: `max_new_tokens`, or with an environment the transcript's
        # (`model.env.max_total_tokens`). Fixed by the producer: kept here, so that no hook asks for it.
        self.completion_budget: int = self.producer.completion_budget
        self._micro_steps_done = 0
        self._correction: Optional[str] = None  # `rollout_correction()`, resolved once a fit (`on_fit_start`)
        self._buffer: Optional[RolloutBatch] = None
        self._normalizers: list[LossNormalizer] = []

    @property
    def reward_names(self) -> list[str]:
        """The reward columns: one per reward function, then an environment's parts (`env/<part>`)."""
        return self.producer.reward_names

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
        """The algorithm's training collection, with the rollout correction's share of tokens it changed (where
        `logs_correction`), the staleness metrics of asynchronous rollouts and the token budget's, as `train/`."""
        if self.logs_correction():
            metrics.add_metrics(rollout_correction_metrics())
        if self.max_staleness > 0:
            metrics.add_metrics(asynchronous_rollout_metrics(self.in_flight_updates, self.max_staleness_lag))
        if self.micro_batch_tokens is not None:
            metrics.add_metrics(token_budget_metrics())
        if self.env_args.enabled:
            metrics.add_metrics(episode_metrics())
        return metrics.clone(prefix="train/")

    def rollout_val_metrics(self) -> MetricCollection:
        """Validation metrics of generating for held-out prompts, one per reward column (and the episodes')."""
        metrics = rollout_eval_metrics(self.reward_names)
        if self.env_args.enabled:
            metrics.add_metrics(episode_metrics())
        return metrics.clone(prefix="val/")

    def uses_reference(self) -> bool:
        """Whether a frozen reference model is loaded (its log-probs land in `RolloutBatch.ref_logprobs`)."""
        return False

    def policy_moves_after_sampling(self) -> bool:
        """Whether an update can meet completions sampled by an older policy: several passes or optimizer steps per
        generation, or generations sampled ahead."""
        schedule = self.schedule_args
        return schedule.num_iterations > 1 or schedule.steps_per_generation > 1 or self.max_staleness > 0

    def rollout_correction(self) -> str:
        """`model.rollout.correction` with `auto` resolved for this run's engine and precision; `none` for an
        algorithm that takes no correction (`rollout_options`)."""
        mode = self.rollout_args.correction
        if "correction" not in self.rollout_options:
            return "none"
        if mode == "auto":  # due when samples lag, or the engine's log-probs can differ from the trainer's by more
            # than rounding (asked only then: a module without its policy yet cannot tell its dtype)
            due = self.max_staleness > 0 or self.engine_config.numerics_differ(self.compute_dtype())
            return self.auto_correction if due else "none"
        return mode

    def logs_correction(self) -> bool:
        """Whether `train/rollout_is_frac_corrected` is logged: a correction asked for by name or made certain by
        asynchrony (`auto` alone keeps the columns of earlier runs)."""
        rollout = self.rollout_args
        taken = "correction" in self.rollout_options
        return taken and (rollout.max_staleness > 0 or rollout.correction not in ("auto", "none"))

    def rollout_importance_weights(self, mb: RolloutBatch, old_logprobs: torch.Tensor) -> Optional[torch.Tensor]:
        """The rollout correction's weights w [N, T] of a micro-batch (`lit_rl.losses.rollout_is_weights`; None:
        no correction), on the model's tokens (observations have no engine log-prob); counts the tokens it changed
        in `rollout_is_frac_corrected`."""
        if self._correction is None:  # a micro-batch outside `fit`
            self._correction = self.rollout_correction()
        model_tokens = model_token_mask(mb)
        weights, corrected = rollout_is_weights(
            self._correction, old_logprobs, mb.rollout_logprobs, model_tokens, self.rollout_args.correction_cap
        )
        if corrected is not None and "rollout_is_frac_corrected" in self.train_metrics:
            self.train_metrics["rollout_is_frac_corrected"].update(corrected[model_tokens > 0].float())
        return weights

    def needs_old_logprobs(self) -> bool:
        """Whether the policy's log-probs at generation time are computed (else the first pass reuses its own)."""
        return self.policy_moves_after_sampling()

    def shape_rewards(self, rewards: torch.Tensor, out: RolloutOutput) -> torch.Tensor:
        """The rewards [N] advantages are computed from, given this rank's completions (default: unchanged)."""
        return rewards

    def loss_mask(self, batch: RolloutBatch) -> torch.Tensor:
        """[N, T]: the tokens the loss and its denominators count (default: every token the model sampled). Called
        once per batch, when it is built; the hooks after it read `batch.loss_mask`."""
        return model_token_mask(batch)

    def finish_rollout(
        self, batch: RolloutBatch, all_rewards: torch.Tensor, mine: slice, group_filter: Optional[GroupFilterStats]
    ) -> None:
        """Fill `batch.advantages` (and any algorithm field) from every rank's rewards `all_rewards` [world*N], of
        which `mine` are this rank's rows (those of `batch`); `group_filter`: dynamic sampling's numbers of the
        generation (None without it)."""
        raise NotImplementedError

    def micro_batch_loss(
        self, mb: RolloutBatch, terms: MicroBatchTerms, normalizer: LossNormalizer
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The micro-batch's share of the step loss (denominators from `normalizer`) and per-token stats, from
        what the module computed for it (`terms`: this pass's log-probs, the ratio's old ones, the rollout
        correction's weights); the tokens it counts are `mb.loss_mask`."""
        raise NotImplementedError

    def update_algorithm_metrics(self, mb: RolloutBatch, loss: torch.Tensor, stats: dict[str, torch.Tensor]) -> None:
        """Update the algorithm's own training metrics for this micro-batch."""

    # -- set-up ----------------------------------------------------------------------------------------------
    def configure_model(self) -> None:
        super().configure_model()
        if self.uses_reference() and self.ref_model is None and not self.reference_is_adapter_off():
            self.ref_model = self.load_reference()

    def teardown(self, stage: str) -> None:
        self.producer.close()

    def configure_callbacks(self) -> list[L.Callback]:
        return [ClosesRolloutsOnFailure()]

    def setup(self, stage: str) -> None:
        if self.engine_config.colocated:
            self.engines.placement()  # rejects a TP size that does not fit the ranks, before anything starts
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
        # The engine and the trainer's precision are fixed from here: `auto` is resolved once, not per micro-batch.
        self._correction = self.rollout_correction()

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
            refill_generations=self.producer.refills_offered,
        )

    batch_type: type[RolloutBatch] = RolloutBatch  # the rollout batch, with the algorithm's own fields
    rollout_options: tuple[str, ...] = ()  # the options of `ROLLOUT_OPTION_TAKERS` this one takes
    auto_correction = "token_truncate"  # what `model.rollout.correction: auto` is when a correction is due

    @property
    def optimizer_steps_per_generation(self) -> int:
        """m = steps_per_generation x num_iterations: the optimizer steps taken on one generation."""
        return self.schedule_args.steps_per_generation * self.schedule_args.num_iterations

    @property
    def max_staleness_lag(self) -> int:
        """The stalest a trained sample can be: k + m - 1 (`max_staleness` k; a generation's later steps add their
        offset within it, up to m - 1)."""
        return self.max_staleness + self.optimizer_steps_per_generation - 1

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

    @torch.no_grad()
    def make_rollout(self, scored: ScoredCompletions) -> RolloutBatch:
        """The rollout batch of this rank's scored completions of a generation (from the producer): shaped
        rewards, their groups' statistics, the old and reference log-probs, and what the algorithm adds
        (`finish_rollout`: advantages, or pairs)."""
        G, out = self.sampling_args.num_generations, scored.output
        if self.engine_config.samples_on_trainer_devices:
            self.count_flops(scored.prompt_ids, scored.prompt_mask, out.completion_mask)  # the generation's
        rewards = self.shape_rewards(scored.rewards, out)
        self.producer.release()  # sleep mode: the log-prob forwards and the update get the engine's memory
        # Every rank's rewards in global slot order: a group may span ranks, so group statistics use them all.
        all_rewards = self.all_gather(rewards).reshape(-1)  # [world*N]
        mine = rank_slice(self.global_rank, len(rewards))  # this rank's rows of all_rewards
        group_std = group_reward_std(all_rewards, G)[mine]
        batch = self.batch_type(
            prompt_ids=scored.prompt_ids,
            prompt_mask=scored.prompt_mask,
            completion_ids=out.completion_ids,
            completion_mask=out.completion_mask,
            rollout_logprobs=out.logprobs,
            rewards=rewards,
            reward_components=scored.reward_components,
            advantages=torch.zeros_like(rewards),
            group_reward_std=group_std,
            policy_version=scored.row_versions(),
            token_versions=out.token_versions if self.in_flight_updates else None,
            sampled_mask=out.sampled_mask,
            episode_stats=out.episode_stats,
        )
        batch.loss_mask = self.loss_mask(batch)
        if self.needs_old_logprobs():
            with self.timer.phase("old_logprobs"):
                batch.old_logprobs = self._logprobs_in_chunks(self.policy, batch)
        if self.uses_reference():
            with self.timer.phase("ref_logprobs"), self.reference_model() as ref_model:
                batch.ref_logprobs = self._logprobs_in_chunks(ref_model, batch)
        self.finish_rollout(batch, all_rewards, mine, scored.group_filter)
        world_size, batcher = self.trainer.world_size, self.micro_batcher
        self._normalizers = batcher.step_normalizers(batch, self.completion_budget, world_size)
        if self.micro_batch_tokens is not None and world_size > 1:
            pad = self.tokenizer.pad_token_id
            batch = batcher.balanced_across_ranks(batch, self.gather_stacked, world_size, self.global_rank, pad)
        return batch

    def _launch(self, launches: Iterable[tuple[int, list[dict[str, Any]]]]) -> None:
        """Start sampling each (generation, rows) of `launches` in the background (asynchronous rollouts)."""
        for launched, rows in launches:
            self.producer.launch(launched, rows)

    def _logprobs_in_chunks(self, model: torch.nn.Module, batch: RolloutBatch) -> torch.Tensor:
        temperature = self.sampling_args.temperature
        return self.per_micro_batch(
            batch,
            lambda mb: (
                self.score_completions(
                    model, mb.prompt_ids, mb.prompt_mask, mb.completion_ids, mb.completion_mask, temperature
                ).logprobs
            ),
        )

    def per_micro_batch(self, batch: RolloutBatch, score: Callable[[RolloutBatch], torch.Tensor]) -> torch.Tensor:
        """`score` over `batch` a micro-batch at a time (`MicroBatcher.per_micro_batch`), as many forwards on every
        rank when the parameters are sharded (each forward gathers them from all ranks)."""
        if not self.parameters_sharded():
            return self.micro_batcher.per_micro_batch(batch, score)

        def most_on_any_rank(count: int) -> int:
            return int(reduce_across_ranks(torch.tensor(count, device=self.device), "max"))

        return self.micro_batcher.per_micro_batch(batch, score, most_on_any_rank)

    # -- training --------------------------------------------------------------------------------------------
    def training_step(self, batch: ScheduledMicroStep, batch_idx: int) -> torch.Tensor:
        if batch.micro_step != self._micro_steps_done:
            raise RuntimeError(
                f"rollout schedule drifted: loader gave micro-step {batch.micro_step}, "
                f"the module expected {self._micro_steps_done}"
            )
        generation, generation_micro_step = divmod(batch.micro_step, self.micro_steps_per_generation)
        launches = batch.launches or ()  # asynchronous rollouts: (generation, rows) to sample ahead
        if generation_micro_step == 0:
            later = ()
            if self.producer.samples_when_taken:  # refills, by the current weights: not queued behind later ones
                later = [(launched, rows) for launched, rows in launches if launched > generation]
                launches = [(launched, rows) for launched, rows in launches if launched <= generation]
            self._launch(launches)
            scored = self.producer.generation(generation, batch.rows, batch.refills)
            self._launch(later)
            self._buffer = self.make_rollout(scored)
        else:
            self._launch(launches)
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
        terms = self.micro_batch_terms(mb, logprobs)
        loss, stats = self.micro_batch_loss(mb, terms, self._normalizers[index // self.accumulate])
        if has_completions:
            if self.micro_batch_tokens is not None:
                self.train_metrics["micro_batch_tokens/max"].update(mb.prompt_mask.sum() + mb.completion_mask.sum())
            first_pass = generation_micro_step < micro_batches
            update_on_policy_metrics(
                self.train_metrics,
                self.reward_names,
                mb,
                scores.entropy,
                fresh_logprobs=logprobs if first_pass else None,
                global_step=self.trainer.global_step,
                max_lag=self.max_staleness_lag if self.max_staleness > 0 else None,
            )
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

    def micro_batch_terms(self, mb: RolloutBatch, logprobs: torch.Tensor) -> MicroBatchTerms:
        """What `micro_batch_loss` reads besides the micro-batch: this pass's log-probs; the old ones, the
        sampling policy's by the trainer when the policy has moved since sampling, else these very log-probs,
        detached (ratio 1: the old ones, where computed for a KL penalty, would only add rounding to the clipping);
        the rollout correction's weights against the engine's log-probs."""
        moved = mb.old_logprobs is not None and self.policy_moves_after_sampling()
        old_logprobs = mb.old_logprobs if moved else logprobs.detach()
        return MicroBatchTerms(
            logprobs=logprobs,
            old_logprobs=old_logprobs,
            importance_weights=self.rollout_importance_weights(mb, old_logprobs),
        )

    def on_validation_start(self) -> None:
        super().on_validation_start()
        self.producer.before_validation()  # asynchronous: the generations in flight finish first

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
            scored = self.producer.sample(batch["rows"], G, self.sampling_params(training=False))
        out, rewards = scored.output, scored.rewards
        group_std = group_reward_std(rewards, G)
        weight = batch["weight"].to(rewards).repeat_interleave(G)  # 0 on rows that pad this rank's share
        model_tokens = model_token_mask(out)
        names = self.reward_names
        update_rollout_metrics(
            self.val_metrics, names, rewards, scored.reward_components, model_tokens, group_std, weight
        )
        update_episode_metrics(self.val_metrics, out.episode_stats, weight)

    def on_validation_epoch_end(self) -> None:
        self.producer.release()  # after the last validation batch: all of them share one push
        self.log_collection(self.val_metrics, on_step=False, prog_bar=("reward",))
        self.log_validated_step()
