"""GRPO (Shao et al. 2024, "DeepSeekMath") with the Dr. GRPO and DAPO aggregations.

The rollout schedule, buffer, validation and checkpoint state are `OnPolicyModule`'s; this file is the GRPO
objective: group-relative advantages and the clipped per-token surrogate with a per-token KL term
(`lit_rl.losses.grpo`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch
from torchmetrics import MetricCollection

from lit_rl.algorithms.on_policy import MicroBatchTerms, OnPolicyModule
from lit_rl.config import (
    GRPO_ROLLOUT_OPTIONS,
    EnvArgs,
    OptimArgs,
    PolicyArgs,
    RewardArgs,
    RolloutArgs,
    SamplingArgs,
    ScheduleArgs,
    as_args,
)
from lit_rl.loss_config import GRPOLoss
from lit_rl.losses import LossNormalizer, grpo_loss
from lit_rl.losses.advantages import advantage_function
from lit_rl.losses.overlong import overlong_penalty, truncated
from lit_rl.losses.policy import policy_loss_function
from lit_rl.modeling.models import model_eos_token_ids
from lit_rl.rollout import RolloutOutput
from lit_rl.rollout.dynamic_sampling import ZERO_STD, DynamicSampling
from lit_rl.rollout.producer import GroupFilterStats
from lit_rl.training.metrics import mean, metric_collection, on_policy_training_metrics
from lit_rl.types import RolloutBatch, model_token_mask


@dataclass
class GRPOBatch(RolloutBatch):
    """GRPO's rollout batch: the shared fields, and with dynamic sampling (`model.rollout.dynamic_sampling`) the
    generation's refills and fraction of groups dropped, the same on each of its rows (a step's metrics then weigh
    them by the completions it trained on, and a resumed run keeps them with the buffer)."""

    refill_generations: Optional[torch.Tensor] = None  # [N] float
    frac_groups_dropped: Optional[torch.Tensor] = None  # [N] float


class GRPO(OnPolicyModule):
    """Group Relative Policy Optimization.

    Every option is in a group (`lit_rl.config`; its `loss` group is `lit_rl.loss_config.GRPOLoss`). The rollout
    group's correction and dynamic sampling (`model.rollout.correction`, `model.rollout.dynamic_sampling`) are
    GRPO's alone.
    """

    rollout_options = GRPO_ROLLOUT_OPTIONS
    batch_type = GRPOBatch

    def __init__(
        self,
        policy: PolicyArgs = PolicyArgs(),
        optim: OptimArgs = OptimArgs(),
        schedule: ScheduleArgs = ScheduleArgs(),
        sampling: SamplingArgs = SamplingArgs(),
        rewards: RewardArgs = RewardArgs(),
        env: EnvArgs = EnvArgs(),
        loss: GRPOLoss = GRPOLoss(),
        rollout: RolloutArgs = RolloutArgs(),
    ) -> None:
        self.loss_args = loss = as_args(GRPOLoss, loss)
        sampling = as_args(SamplingArgs, sampling)
        sampling.check()  # first: the loss's limits are read from it (a bad max_new_tokens is named as itself)
        loss.check(max_new_tokens=sampling.max_new_tokens)
        super().__init__(policy, optim, schedule, sampling, rewards, env, rollout)
        self.save_hyperparameters()
        rollout = self.rollout_args
        self.policy_loss_fn = policy_loss_function(loss.objective)  # functions, not modules: never saved as weights
        self.advantage_fn = advantage_function(loss.advantage)
        metrics = grpo_metrics(self.reward_names, with_kl=loss.beta != 0.0)
        if rollout.dynamic_sampling:
            metrics.add_metrics(dynamic_sampling_metrics())
        self.train_metrics = self.rollout_train_metrics(metrics)
        if rollout.dynamic_sampling:  # DAPO's group filter around the producer, judging the shaped rewards
            self.producer = DynamicSampling(
                self.producer, self.sampling_args.num_generations, self.shape_rewards, rollout.max_refill_generations
            )
        self.val_metrics = self.rollout_val_metrics()

    def uses_reference(self) -> bool:
        return self.loss_args.beta != 0.0

    def finish_rollout(
        self, batch: GRPOBatch, all_rewards: torch.Tensor, mine: slice, group_filter: Optional[GroupFilterStats]
    ) -> None:
        advantages, _ = self.advantage_fn(all_rewards, self.sampling_args.num_generations, self.loss_args.scale_rewards)
        batch.advantages = advantages[mine]
        if group_filter is not None:  # `DynamicSampling.generation`'s numbers
            batch.refill_generations = torch.full_like(batch.rewards, float(group_filter.refill_generations))
            batch.frac_groups_dropped = torch.full_like(batch.rewards, float(group_filter.frac_groups_dropped))

    def shape_rewards(self, rewards: torch.Tensor, out: RolloutOutput) -> torch.Tensor:
        loss = self.loss_args
        if loss.overlong_buffer == 0:  # no soft overlong punishment (the default)
            return rewards
        lengths = out.completion_mask.sum(dim=1)  # [N] (with an environment: the transcript, against its budget)
        return rewards - overlong_penalty(lengths, self.completion_budget, loss.overlong_buffer, loss.overlong_penalty)

    def loss_mask(self, batch: RolloutBatch) -> torch.Tensor:
        model_tokens = model_token_mask(batch)
        if not self.loss_args.overlong_filter:
            return model_tokens
        eos = model_eos_token_ids(self.policy, self.tokenizer.eos_token_id)
        cut_off = truncated(batch.completion_ids, model_tokens, eos)  # [N]: did the model's last token end it?
        return model_tokens * (~cut_off).to(model_tokens.dtype)[:, None]

    def micro_batch_loss(
        self, mb: RolloutBatch, terms: MicroBatchTerms, normalizer: LossNormalizer
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return grpo_loss(
            terms.logprobs,
            terms.old_logprobs,
            mb.advantages,
            mb.loss_mask,
            aggregation=self.loss_args.aggregation,
            normalizer=normalizer,
            ref_logprobs=mb.ref_logprobs,
            beta=self.loss_args.beta,
            epsilon_low=self.loss_args.epsilon,
            epsilon_high=self.loss_args.clip_high,
            importance_weights=terms.importance_weights,
            policy_loss=self.policy_loss_fn,
        )

    def update_algorithm_metrics(self, mb: GRPOBatch, loss: torch.Tensor, stats: dict[str, torch.Tensor]) -> None:
        m = self.train_metrics
        if mb.refill_generations is not None:
            m["refill_generations"].update(mb.refill_generations)
            m["frac_groups_dropped"].update(mb.frac_groups_dropped)
        tokens = model_token_mask(mb) > 0
        m["loss"].update(loss.detach())
        m["frac_reward_zero_std"].update((mb.group_reward_std < ZERO_STD).float())
        m["clip_ratio/low"].update(stats["clipped_low"][tokens])
        m["clip_ratio/high"].update(stats["clipped_high"][tokens])
        if "kl" in stats:
            m["kl"].update(stats["kl"][tokens])


# -- metrics ----------------------------------------------------------------------------------------------------------
def grpo_metrics(reward_names: Iterable[str], with_kl: bool) -> MetricCollection:
    """Metrics of GRPO-style training: the on-policy ones, the clipping, and when beta > 0 the KL (a rollout
    correction's are added by `OnPolicyModule.rollout_train_metrics`)."""
    metrics = {
        **on_policy_training_metrics(reward_names),
        "frac_reward_zero_std": mean("completion"),
        "clip_ratio/low": mean("token"),
        "clip_ratio/high": mean("token"),
    }
    if with_kl:
        metrics["kl"] = mean("token")
    return metric_collection(metrics)


def dynamic_sampling_metrics() -> dict:
    """What dynamic sampling adds: the refill generations a step's generation sampled, and the fraction of all the
    groups it sampled (its own and the refills') that were dropped for rewards that all agree. Both are one number
    per generation, on each of its completions."""
    return {"refill_generations": mean("completion"), "frac_groups_dropped": mean("completion")}
