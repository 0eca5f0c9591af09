"""RLOO (Ahmadian et al. 2024): REINFORCE with a leave-one-out baseline, a KL penalty folded into the reward,
and a sequence-level PPO-clipped importance ratio (`lit_rl.losses.rloo`).

The rollout correction (`model.rollout.correction`) weighs each sequence's term, as the loss is per sequence:
`sequence_truncate` (what `auto` is with asynchronous rollouts or an engine whose numerics differ) or
`sequence_mask`; `token_truncate` has no sequence weight and is refused.

The rollout schedule, buffer, validation and checkpoint state are `OnPolicyModule`'s, so `global_step` is
Lightning's: the checkpoint cadence is exact for any accumulation, `num_iterations` or resume.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch
from torchmetrics import MetricCollection

from lit_rl.algorithms.on_policy import MicroBatchTerms, OnPolicyModule
from lit_rl.config import EnvArgs, OptimArgs, PolicyArgs, RewardArgs, RolloutArgs, SamplingArgs, ScheduleArgs, as_args
from lit_rl.errors import ConfigError
from lit_rl.loss_config import RLOOLoss
from lit_rl.losses import LossNormalizer
from lit_rl.losses.rloo import kl_penalized_rewards, rloo_advantages, rloo_loss
from lit_rl.rollout.producer import GroupFilterStats
from lit_rl.training.metrics import mean, metric_collection, on_policy_training_metrics
from lit_rl.types import RolloutBatch


@dataclass
class RLOOBatch(RolloutBatch):
    """RLOO's rollout batch: the shared fields, and per sequence the KL its reward was penalised by and the spread
    of the generation's advantages."""

    kl: Optional[torch.Tensor] = None  # [N] with beta > 0: sum_t (old_logprobs - ref_logprobs), the penalty's KL
    advantage_std: Optional[torch.Tensor] = None  # [N] the std of the generation's advantages, on every row


class RLOO(OnPolicyModule):
    """REINFORCE Leave-One-Out.

    The option groups it takes (`policy`, `optim`, ...) are documented in `lit_rl.config`, its `loss` group in
    `lit_rl.loss_config.RLOOLoss`.
    """

    rollout_options = ("correction", "correction_cap")  # the rollout correction, per sequence
    batch_type = RLOOBatch
    auto_correction = "sequence_truncate"

    def __init__(
        self,
        policy: PolicyArgs = PolicyArgs(),
        optim: OptimArgs = OptimArgs(),
        schedule: ScheduleArgs = ScheduleArgs(),
        sampling: SamplingArgs = SamplingArgs(num_generations=4),
        rewards: RewardArgs = RewardArgs(),
        env: EnvArgs = EnvArgs(),
        loss: RLOOLoss = RLOOLoss(),
        rollout: RolloutArgs = RolloutArgs(),
    ) -> None:
        self.loss_args = loss = as_args(RLOOLoss, loss)
        loss.check()
        if as_args(RolloutArgs, rollout).correction == "token_truncate":
            raise ConfigError(
                "model.rollout.correction token_truncate: RLOO's loss is per sequence, so its correction weighs "
                "sequences: use sequence_truncate (what auto gives) or sequence_mask"
            )
        super().__init__(policy, optim, schedule, sampling, rewards, env, rollout)
        self.save_hyperparameters()
        metrics = rloo_metrics(self.reward_names, with_kl=loss.beta != 0.0)
        self.train_metrics = self.rollout_train_metrics(metrics)
        self.val_metrics = self.rollout_val_metrics()

    def uses_reference(self) -> bool:
        return self.loss_args.beta != 0.0

    def needs_old_logprobs(self) -> bool:
        # The KL penalty is part of the reward, so it needs the sampling policy's log-probs at generation time.
        return self.loss_args.beta != 0.0 or super().needs_old_logprobs()

    def finish_rollout(
        self, batch: RLOOBatch, all_rewards: torch.Tensor, mine: slice, group_filter: Optional[GroupFilterStats]
    ) -> None:
        args = self.loss_args
        rewards = batch.rewards
        if batch.ref_logprobs is not None:
            rewards, batch.kl = kl_penalized_rewards(
                rewards, batch.old_logprobs, batch.ref_logprobs, batch.loss_mask, args.beta
            )
        all_penalized = self.all_gather(rewards).reshape(-1) if self.trainer.world_size > 1 else rewards
        advantages = rloo_advantages(all_penalized, self.sampling_args.num_generations, args.normalize_advantages)
        batch.advantages = advantages[mine]
        batch.advantage_std = advantages.std().expand(len(batch)).clone()

    def micro_batch_loss(
        self, mb: RLOOBatch, terms: MicroBatchTerms, normalizer: LossNormalizer
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        weights = terms.importance_weights  # [N, T]: the sequence's weight on its tokens
        return rloo_loss(
            terms.logprobs,
            terms.old_logprobs,
            mb.advantages,
            mb.loss_mask,
            self.loss_args.epsilon,
            num_sequences=normalizer.num_sequences,
            epsilon_high=self.loss_args.clip_high,
            sequence_weights=None if weights is None else weights.amax(dim=1),
        )

    def update_algorithm_metrics(self, mb: RLOOBatch, loss: torch.Tensor, stats: dict[str, torch.Tensor]) -> None:
        m = self.train_metrics
        m["loss"].update(loss.detach())
        m["clip_ratio"].update(stats["clipped"])
        m["advantage_std"].update(mb.advantage_std)
        if mb.kl is not None:
            m["kl"].update(mb.kl)


# -- metrics ----------------------------------------------------------------------------------------------------------
def rloo_metrics(reward_names: Iterable[str], with_kl: bool) -> MetricCollection:
    """Metrics of RLOO: `reward` is the task reward (before the KL penalty); `advantage_std` the std of the
    generation's advantages (on each of its completions); `clip_ratio` the fraction of completions whose
    sequence-level ratio was clipped; with beta > 0 `kl`, the mean per-sequence KL penalised in the reward."""
    metrics = {
        **on_policy_training_metrics(reward_names),
        "advantage_std": mean("completion"),
        "clip_ratio": mean("completion"),
    }
    if with_kl:
        metrics["kl"] = mean("completion")
    return metric_collection(metrics)
