"""PPO with a learned critic (Schulman et al. 2017; for language models Ouyang et al. 2022).

Each completion is an episode: its reward arrives at the last token, a per-token KL penalty to the reference
(beta > 0) at every token, and a critic (`lit_rl.modeling.value_model.ValueModel`, a separate network initialised from
the policy's weights or `critic_model_name_or_path`) gives the baseline V(s_t). At generation time the critic's values,
GAE advantages and returns are computed once (`lit_rl.losses.ppo`), and the advantages whitened over every real
token of the generation on every rank. Each micro-step then trains both networks with one loss:

    loss = policy_loss + value_loss_coef * value_loss
    policy_loss = aggregate_t( -min(r_t A_t, clip(r_t, 1 - epsilon, 1 + epsilon) A_t) )
    value_loss  = aggregate_t( 0.5 * max((V_t - G_t)^2, (V_old_t + clip(V_t - V_old_t, -c, c) - G_t)^2) )

with the named aggregation of `lit_rl.losses.aggregation` (default `token`: the mean over the optimizer step's tokens on
all ranks, as OpenRLHF and verl). The critic's parameters are an AdamW group of their own at
`critic_learning_rate`; `trainer.gradient_clip_val` clips both networks' gradients together (as TRL does), and that
is all `value_loss_coef` changes: the networks share no parameter, and AdamW's step does not depend on a gradient's
scale. `value_clip` is in reward units: with rewards far from [0, 1], scale it (or the rewards) to match. The
schedule, buffer, validation and checkpoints are `OnPolicyModule`'s, so the
checkpoint cadence and exact resume hold as for GRPO; the critic is in every checkpoint and exported next to the
policy (`hf/critic`: `lit_rl.modeling.value_model.save_value_state`).

With an environment (`model.env.environment` or `model.env.tools`) a completion is a multi-turn transcript, and only the
model's tokens are actions: the rewards, GAE, both losses and the token metrics run over them alone, the
environment's tokens between turns skipped as `lit_rl.losses.ppo` describes.

Asynchronous rollouts (`model.rollout.max_staleness = k > 0`): a generation sampled by the policy k steps back is
taken when its first update comes. The critic's values, the advantages and the old log-probs are computed then, by
the critic and policy being trained (training time, not sampling time): V estimates the value of the policy the
update improves, and the sampling critic's values are not kept (nor would they be better: that critic is older).
The engine's log-probs then weigh the policy term with the rollout correction of `model.rollout.correction`
(`auto`: `token_truncate`, w_t = min(exp(old_logp_t - engine_logp_t), correction_cap);
`lit_rl.losses.rollout_is_weights`): policy_loss = aggregate_t( w_t * -min(r_t A_t, clip(r_t, ...) A_t) ).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch
from torchmetrics import MetricCollection

from lit_rl.algorithms.on_policy import MicroBatchTerms, OnPolicyModule
from lit_rl.config import EnvArgs, OptimArgs, PolicyArgs, RewardArgs, RolloutArgs, SamplingArgs, ScheduleArgs, as_args
from lit_rl.errors import ConfigError
from lit_rl.loss_config import PPOLoss
from lit_rl.losses import LossNormalizer, aggregate
from lit_rl.losses.policy import ppo_clip
from lit_rl.losses.ppo import clipped_value_loss, gae, masked_moments, moments_to_mean_std, token_rewards, whiten
from lit_rl.modeling.completions import completion_forward
from lit_rl.modeling.value_model import ValueModel, load_value_model
from lit_rl.rollout.producer import GroupFilterStats
from lit_rl.training.flops import ModelShape
from lit_rl.training.metrics import explained_variance, mean, metric_collection, on_policy_training_metrics, total
from lit_rl.training.strategies import hf_zero3_loading, reduce_across_ranks
from lit_rl.types import RolloutBatch, completion_field


@dataclass
class PPOBatch(RolloutBatch):
    """PPO's rollout batch: the shared fields, and per token the critic's values, GAE advantages and returns
    (`lit_rl.losses.ppo`)."""

    kl: Optional[torch.Tensor] = None  # [N] with beta > 0: sum_t (old_logprobs - ref_logprobs), penalised in the reward
    old_values: Optional[torch.Tensor] = completion_field()  # [N, T] float
    token_advantages: Optional[torch.Tensor] = completion_field()  # [N, T] float, whitened with normalize_advantages
    returns: Optional[torch.Tensor] = completion_field()  # [N, T] float


class PPO(OnPolicyModule):
    """Proximal Policy Optimization with a critic, GAE and value clipping.

    The option groups it takes (`policy`, `optim`, ...) are documented in `lit_rl.config`, its `loss` group in
    `lit_rl.loss_config.PPOLoss`.

    Args:
        critic_model_name_or_path: the model the critic starts from (None: the policy's): a causal LM (its decoder,
            and a value head at 0), a one-label reward model or an exported critic (decoder and head); it must share
            the policy's tokenizer (`lit_rl.modeling.value_model.load_value_model`).
        critic_learning_rate: AdamW learning rate of the critic (None: `optim.learning_rate`).
    """

    rollout_options = ("correction", "correction_cap")  # the rollout correction of asynchronous rollouts
    batch_type = PPOBatch

    def __init__(
        self,
        policy: PolicyArgs = PolicyArgs(),
        optim: OptimArgs = OptimArgs(),
        schedule: ScheduleArgs = ScheduleArgs(),
        sampling: SamplingArgs = SamplingArgs(num_generations=4),
        rewards: RewardArgs = RewardArgs(),
        env: EnvArgs = EnvArgs(),
        loss: PPOLoss = PPOLoss(),
        critic_model_name_or_path: Optional[str] = None,
        critic_learning_rate: Optional[float] = None,
        rollout: RolloutArgs = RolloutArgs(),
    ) -> None:
        self.loss_args = loss = as_args(PPOLoss, loss)
        loss.check()
        if critic_learning_rate is not None and critic_learning_rate < 0:
            raise ConfigError(f"model.critic_learning_rate must be >= 0, got {critic_learning_rate}")
        super().__init__(policy, optim, schedule, sampling, rewards, env, rollout, min_generations=1)
        self.save_hyperparameters()
        self.critic_model_name_or_path, self.critic_learning_rate = critic_model_name_or_path, critic_learning_rate
        self.critic: Optional[ValueModel] = None  # built in `configure_model`, like the policy
        self.critic_shape: Optional[ModelShape] = None  # its model FLOPs (`lit_rl.training.flops`)
        metrics = ppo_metrics(self.reward_names, with_kl=loss.beta != 0.0)
        self.train_metrics = self.rollout_train_metrics(metrics)
        self.val_metrics = self.rollout_val_metrics()

    # -- the critic ------------------------------------------------------------------------------------------
    def configure_model(self) -> None:
        super().configure_model()
        if self.critic is None:
            policy = self.policy_args
            strategy = self.attached_strategy()
            with hf_zero3_loading(strategy):
                self.critic = load_value_model(
                    self.critic_model_name_or_path or policy.model_name_or_path,
                    num_embeddings=len(self.tokenizer),
                    dtype=policy.dtype,
                    gradient_checkpointing=policy.gradient_checkpointing,
                    trust_remote_code=policy.trust_remote_code,
                    attn_implementation=policy.attn_implementation,
                ).train()
        if self.critic_shape is None:
            self.critic_shape = ModelShape.of(self.critic)

    def optimizer_param_groups(self) -> list[dict]:
        critic_lr = self.critic_learning_rate
        critic_lr = self.optim_args.learning_rate if critic_lr is None else critic_lr
        critic = {"params": [p for p in self.critic.parameters() if p.requires_grad], "lr": critic_lr}
        return [*super().optimizer_param_groups(), critic]

    def critic_values(self, mb: PPOBatch) -> torch.Tensor:
        """The critic's V(s_t) [N, T] in float32, at the positions that predict each completion token (0 where
        the completion mask is 0), with this run's forward settings (sharding, padding-free)."""
        backward = torch.is_grad_enabled()  # training the critic
        self.count_flops(mb.prompt_ids, mb.prompt_mask, mb.completion_mask, backward, shape=self.critic_shape)
        values = completion_forward(
            self.critic,
            mb.prompt_ids,
            mb.prompt_mask,
            mb.completion_ids,
            mb.completion_mask,
            synced_ranks=self.parameters_sharded(),
            padding_free=self.padding_free,
        )[..., 0]
        return values.float() * mb.completion_mask

    # -- rollout ---------------------------------------------------------------------------------------------
    def exported_critic(self) -> Optional[ValueModel]:
        """The critic the HF export writes beside the policy (`lit_rl.callbacks.export.TrainsCritic`)."""
        return self.critic

    def uses_reference(self) -> bool:
        return self.loss_args.beta != 0.0

    def needs_old_logprobs(self) -> bool:
        # The KL penalty is part of the reward, so it needs the sampling policy's log-probs at generation time.
        return self.loss_args.beta != 0.0 or self.policy_moves_after_sampling()

    def finish_rollout(
        self, batch: PPOBatch, all_rewards: torch.Tensor, mine: slice, group_filter: Optional[GroupFilterStats]
    ) -> None:
        args = self.loss_args
        mask = batch.loss_mask  # the model's tokens: every completion token without an environment
        with self.timer.phase("values"):
            batch.old_values = self.per_micro_batch(batch, self.critic_values)
        kl = None
        if batch.ref_logprobs is not None:
            kl = (batch.old_logprobs - batch.ref_logprobs) * mask  # [N, T]
            batch.kl = kl.sum(dim=1)
        rewards = token_rewards(batch.rewards, mask, kl, args.beta)
        advantages, batch.returns = gae(rewards, batch.old_values, mask, args.gamma, args.lam)
        if args.normalize_advantages:
            moments = masked_moments(advantages, mask)
            if self.trainer.world_size > 1:
                moments = reduce_across_ranks(moments)
            centre, scale = moments_to_mean_std(moments)
            advantages = whiten(advantages, mask, centre, scale)
        batch.token_advantages = advantages
        # One number per sequence for what reads `advantages` (the empty micro-step zeroes it): the token mean.
        batch.advantages = advantages.sum(dim=1) / mask.sum(dim=1).clamp(min=1)

    # -- training --------------------------------------------------------------------------------------------
    def micro_batch_loss(
        self, mb: PPOBatch, terms: MicroBatchTerms, normalizer: LossNormalizer
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        args, mask = self.loss_args, mb.loss_mask
        policy_per_token, stats = ppo_clip(
            terms.logprobs, terms.old_logprobs, mb.token_advantages, mask, args.epsilon, args.clip_high
        )
        if terms.importance_weights is not None:
            policy_per_token = policy_per_token * terms.importance_weights
        values = self.critic_values(mb)
        value_per_token, value_stats = clipped_value_loss(values, mb.old_values, mb.returns, args.value_clip)
        policy_loss = aggregate(policy_per_token, mask, args.aggregation, normalizer)
        value_loss = aggregate(value_per_token, mask, args.aggregation, normalizer)
        stats = {
            "clipped": torch.maximum(stats["clipped_low"], stats["clipped_high"]),
            "value_clipped": value_stats["clipped"],
            "policy_loss": policy_loss.detach(),
            "value_loss": value_loss.detach(),
            "tokens": mask > 0,  # the tokens the metrics count
        }
        return policy_loss + args.value_loss_coef * value_loss, stats

    def update_algorithm_metrics(self, mb: PPOBatch, loss: torch.Tensor, stats: dict[str, torch.Tensor]) -> None:
        m, tokens = self.train_metrics, stats["tokens"]
        m["loss"].update(loss.detach())
        m["policy_loss"].update(stats["policy_loss"])
        m["critic/value_loss"].update(stats["value_loss"])
        m["clip_ratio"].update(stats["clipped"][tokens])
        m["critic/value_clip_ratio"].update(stats["value_clipped"][tokens])
        m["critic/values"].update(mb.old_values[tokens])
        m["critic/returns"].update(mb.returns[tokens])
        m["critic/explained_variance"].update(mb.old_values[tokens], mb.returns[tokens])
        if mb.kl is not None:
            m["kl"].update(mb.kl)


# -- metrics ----------------------------------------------------------------------------------------------------------
def ppo_metrics(reward_names: Iterable[str], with_kl: bool) -> MetricCollection:
    """Metrics of PPO. `loss` = `policy_loss` + `value_loss_coef` x `critic/value_loss` (each a sum of normalised
    micro-batch terms); `clip_ratio` and `critic/value_clip_ratio`: the fractions of tokens whose gradient the
    clipping took away; `critic/values` and `critic/returns`: the per-token means of the critic's values when sampled
    and of the GAE returns; `critic/explained_variance`: 1 - Var(G - V) / Var(G) over the step's tokens (1: the
    critic predicts the returns, <= 0: no better than their mean); with beta > 0 `kl`, the mean per-sequence KL
    penalised in the reward."""
    metrics = {
        **on_policy_training_metrics(reward_names),
        "policy_loss": total("step-normalised micro-batch losses"),
        "critic/value_loss": total("step-normalised micro-batch losses"),
        "clip_ratio": mean("token"),
        "critic/value_clip_ratio": mean("token"),
        "critic/values": mean("token"),
        "critic/returns": mean("token"),
        "critic/explained_variance": explained_variance("token"),
    }
    if with_kl:
        metrics["kl"] = mean("completion")
    return metric_collection(metrics)
