"""Online DPO (Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback").

For each prompt the current policy samples 2 completions; the reward functions rank them (chosen = the higher
reward) and the DPO loss of `lit_rl.losses.dpo` is applied against the frozen reference. Pairs with equal
rewards carry no preference: they are skipped (weight 0) and counted in `frac_tied_pairs`. The step loss is
normalised by the untied pairs of the whole optimizer step on all ranks.

With an environment (`model.env.environment` or `model.env.tools`) each completion is a multi-turn transcript, and a
sequence's log-probability is the sum over the model's tokens alone: the environment's tokens between turns are
not the policy's to choose, and carry no loss.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional

import torch
from torchmetrics import MetricCollection

from lit_rl.algorithms.on_policy import MicroBatchTerms, OnPolicyModule
from lit_rl.config import EnvArgs, OptimArgs, PolicyArgs, RewardArgs, RolloutArgs, SamplingArgs, ScheduleArgs, as_args
from lit_rl.errors import ConfigError
from lit_rl.loss_config import DPOLoss
from lit_rl.losses import LossNormalizer
from lit_rl.losses.dpo import DPO_LOSSES, REFERENCE_FREE, dpo_loss
from lit_rl.rewards.model import RewardModel
from lit_rl.rollout.producer import GroupFilterStats
from lit_rl.training.metrics import DPO_PAIR_METRICS, mean, metric_collection, on_policy_training_metrics
from lit_rl.types import RolloutBatch


class OnlineDPO(OnPolicyModule):
    """Online DPO with reward functions as the judge.

    The option groups it takes (`policy`, `optim`, ...) are documented in `lit_rl.config`, its `loss` group in
    `lit_rl.loss_config.DPOLoss` (every type but the reference-free `simpo`).

    Args:
        reward_model_name_or_path: a sequence-classification reward model (hub id or local directory) whose score
            is added to the reward functions' (weight: the last entry of `rewards.weights` when it has one more
            entry than `rewards.funcs`, else 1.0). Without reward functions (`rewards.funcs` null or `[]`) it is the
            only judge.
    """

    micro_batch_unit = 2  # a pair's two completions are adjacent rows, compared within one micro-batch

    def __init__(
        self,
        policy: PolicyArgs = PolicyArgs(),
        optim: OptimArgs = OptimArgs(),
        schedule: ScheduleArgs = ScheduleArgs(),
        sampling: SamplingArgs = SamplingArgs(num_generations=2),
        rewards: RewardArgs = RewardArgs(),
        env: EnvArgs = EnvArgs(),
        reward_model_name_or_path: Optional[str] = None,
        loss: DPOLoss = DPOLoss(),
        rollout: RolloutArgs = RolloutArgs(),
    ) -> None:
        self.loss_args = loss = as_args(DPOLoss, loss)
        loss.check(allowed=tuple(name for name in DPO_LOSSES if name not in REFERENCE_FREE))
        num_generations = as_args(SamplingArgs, sampling).num_generations
        micro_batch_size = as_args(ScheduleArgs, schedule).micro_batch_size
        if num_generations != 2:
            raise ConfigError(
                f"model.sampling.num_generations must be 2 for Online DPO (one pair per prompt), got {num_generations}"
            )
        if micro_batch_size % 2:
            raise ConfigError(
                f"model.schedule.micro_batch_size must be even (pairs are never split), got {micro_batch_size}"
            )
        # A reward model is one more judge after the reward functions: its weight is the extra last entry of
        # rewards.weights, if any. A new object, so save_hyperparameters keeps the arguments as given.
        judge_weight = 1.0
        functions = as_args(RewardArgs, rewards)
        if reward_model_name_or_path is not None:
            funcs, weights = list(functions.funcs or []), functions.weights
            if weights is not None and len(weights) == len(funcs) + 1:
                weights, judge_weight = list(weights[:-1]), weights[-1]
            functions = dataclasses.replace(functions, funcs=funcs, weights=weights or None)
        super().__init__(policy, optim, schedule, sampling, functions, env, rollout)
        self.save_hyperparameters()
        if reward_model_name_or_path is not None:
            # A plain callable, never an nn.Module attribute: the reward model is not trained or checkpointed.
            self.reward_scorer.add("reward_model", RewardModel(reward_model_name_or_path), judge_weight)
        clash = next((name for name in self.reward_names if f"rewards/{name}" in DPO_PAIR_METRICS), None)
        if clash is not None:  # one metric would average the function's scores and the pairs' numbers together
            raise ConfigError(
                f"model.rewards.funcs: the reward function {clash!r} would log as train/rewards/{clash}, which Online "
                "DPO logs for its pairs (TRL's name): give the function another name"
            )
        self.train_metrics = self.rollout_train_metrics(online_dpo_metrics(self.reward_names))
        self.val_metrics = self.rollout_val_metrics()

    def uses_reference(self) -> bool:
        return True

    def setup(self, stage: str) -> None:
        super().setup(stage)
        judge = self.reward_scorer.functions.get("reward_model")
        if isinstance(judge, RewardModel):
            judge.to(self.device)

    def finish_rollout(
        self, batch: RolloutBatch, all_rewards: torch.Tensor, mine: slice, group_filter: Optional[GroupFilterStats]
    ) -> None:
        """Advantages as preference labels: +1 on the chosen row, -1 on the rejected, 0 on both rows of a tie."""
        pairs = batch.rewards.view(-1, 2)  # [B, 2]
        first_wins = (pairs[:, 0] > pairs[:, 1]).float()
        second_wins = (pairs[:, 1] > pairs[:, 0]).float()
        batch.advantages = torch.stack([first_wins - second_wins, second_wins - first_wins], dim=1).reshape(-1)

    def micro_batch_loss(
        self, mb: RolloutBatch, terms: MicroBatchTerms, normalizer: LossNormalizer
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        args = self.loss_args
        mask = mb.loss_mask  # the model's tokens: every completion token without an environment
        labels = mb.advantages.view(-1, 2)  # [n/2, 2]
        seq_logps = (terms.logprobs * mask).sum(dim=1).view(-1, 2)  # [n/2, 2]
        ref_logps = (mb.ref_logprobs * mask).sum(dim=1).view(-1, 2)
        if args.type == "ipo":  # IPO compares length-averaged log-probs, as in DPO
            lengths = mask.sum(dim=1).clamp(min=1).view(-1, 2)
            seq_logps, ref_logps = seq_logps / lengths, ref_logps / lengths
        chosen_col = (labels[:, 1] > 0).long()  # 0 when the first completion is chosen (or tied)
        pick = lambda values, col: values.gather(1, col[:, None]).squeeze(1)  # noqa: E731
        untied = (labels[:, 0] != 0).float()  # [n/2]
        loss, stats = dpo_loss(
            pick(seq_logps, chosen_col),
            pick(seq_logps, 1 - chosen_col),
            pick(ref_logps, chosen_col),
            pick(ref_logps, 1 - chosen_col),
            args.type,
            args.beta,
            args.label_smoothing,
            num_pairs=max(normalizer.num_active_sequences / 2, 1.0),
            weights=untied,
        )
        stats["untied"] = untied
        stats["chosen_logps"] = pick(seq_logps, chosen_col).detach()
        stats["rejected_logps"] = pick(seq_logps, 1 - chosen_col).detach()
        return loss, stats

    def update_algorithm_metrics(self, mb: RolloutBatch, loss: torch.Tensor, stats: dict[str, torch.Tensor]) -> None:
        m = self.train_metrics
        untied = stats["untied"]
        m["loss"].update(loss.detach())
        m["frac_tied_pairs"].update(1.0 - untied)
        if untied.sum() == 0:  # no untied pair here: a step of ties everywhere logs none of them (0 / 0 pairs)
            return
        for name, key in [
            ("rewards/chosen", "chosen_rewards"),
            ("rewards/rejected", "rejected_rewards"),
            ("rewards/accuracies", "accuracies"),
            ("rewards/margins", "margins"),
            ("logps/chosen", "chosen_logps"),
            ("logps/rejected", "rejected_logps"),
        ]:
            m[name].update(stats[key], untied)  # ties weigh 0


# -- metrics ----------------------------------------------------------------------------------------------------------
def online_dpo_metrics(reward_names: Iterable[str]) -> MetricCollection:
    """Metrics of Online DPO: the rollout's rewards, the DPO pair metrics over untied pairs, `frac_tied_pairs`."""
    return metric_collection(
        {
            **on_policy_training_metrics(reward_names),
            "frac_tied_pairs": mean("pair"),
            **{name: mean("untied pair") for name in DPO_PAIR_METRICS},
        }
    )
