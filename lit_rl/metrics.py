"""One factory per algorithm builds its MetricCollection; modules clone it per stage (`train/`, `val/`).

Every metric syncs across ranks by summing its states, so `compute()` is the exact global value: a `MeanMetric`
updated with per-token or per-sample weights gives the weighted mean over every rank and micro-batch, never a
mean of per-rank means.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torchmetrics import ExplainedVariance, MaxMetric, MeanMetric, MetricCollection, MinMetric, SumMetric


def _collection(metrics: dict) -> MetricCollection:
    # compute_groups=False: metrics are updated one by one with different values; grouping is only valid for
    # metrics that always receive the same inputs.
    return MetricCollection(metrics, compute_groups=False)


def _rollout_metrics(reward_names: Iterable[str]) -> dict:
    """What every rollout is scored on, in training and validation: one sample each, weighted per completion."""
    metrics = {
        "reward": MeanMetric(),
        "reward_std": MeanMetric(),
        "frac_invalid_reward": MeanMetric(),
        "completion_length": MeanMetric(),
    }
    for name in reward_names:
        metrics[f"rewards/{name}"] = MeanMetric()
    return metrics


def _on_policy_training_metrics(reward_names: Iterable[str]) -> dict:
    """The rollout metrics plus what every on-policy training step logs. `loss` is a sum of micro-batch terms
    that are already normalised over the step."""
    return {
        **_rollout_metrics(reward_names),
        "loss": SumMetric(),
        "entropy": MeanMetric(),
        "rollout_logprob_diff/mean": MeanMetric(),
        "rollout_logprob_diff/max": MaxMetric(),
        # Engine-trainer mismatch per sampled token: the importance ratio r = exp(trainer - engine log-prob)
        # and the k3 estimate of KL(engine || trainer), (r - 1) - log r.
        "rollout_kl": MeanMetric(),
        "rollout_is_ratio/min": MinMetric(),
        "rollout_is_ratio/mean": MeanMetric(),
        "rollout_is_ratio/max": MaxMetric(),
    }


def grpo_metrics(reward_names: Iterable[str], with_kl: bool, with_is_correction: bool = False) -> MetricCollection:
    """Metrics of GRPO-style training: the on-policy ones, the clipping, when beta > 0 the KL, and with a rollout
    correction the fraction of completion tokens whose weight it changed (truncated, or masked)."""
    metrics = {
        **_on_policy_training_metrics(reward_names),
        "frac_reward_zero_std": MeanMetric(),
        "clip_ratio/low": MeanMetric(),
        "clip_ratio/high": MeanMetric(),
    }
    if with_kl:
        metrics["kl"] = MeanMetric()
    if with_is_correction:
        metrics["rollout_is_frac_corrected"] = MeanMetric()
    return _collection(metrics)


def asynchronous_rollout_metrics() -> dict:
    """What asynchronous rollouts add: the staleness of each consumed sample, `global_step - policy_version`."""
    return {"staleness/mean": MeanMetric(), "staleness/max": MaxMetric()}


def dynamic_sampling_metrics() -> dict:
    """What dynamic sampling adds: the refill generations a step's generation sampled, and the fraction of all the
    groups it sampled (its own and the refills') that were dropped for rewards that all agree."""
    return {"refill_generations": MeanMetric(), "frac_groups_dropped": MeanMetric()}


def episode_metrics() -> dict:
    """What multi-turn episodes add (`lit_rl.rollout.multi_turn`), means per episode: model `turns`, `tool_calls`,
    `tool_errors` (calls that raised or timed out) and `env_tokens` (observation tokens in the transcript)."""
    return {name: MeanMetric() for name in ("turns", "tool_calls", "tool_errors", "env_tokens")}


def token_budget_metrics() -> dict:
    """What token-budget micro-batches add: the real tokens of the step's largest micro-batch, across ranks (more
    than `model.micro_batch_tokens` when a step was over budget), and the most and the fewest tokens any rank
    trained on in the step (`lit_rl.rank_balance` deals them evenly)."""
    return {"micro_batch_tokens/max": MaxMetric(), "rank_tokens/max": MaxMetric(), "rank_tokens/min": MinMetric()}


def rloo_metrics(reward_names: Iterable[str]) -> MetricCollection:
    """Metrics of RLOO: `reward` is the task reward (before the KL penalty); `kl` the mean per-sequence KL."""
    return _collection(
        {
            **_on_policy_training_metrics(reward_names),
            "kl": MeanMetric(),
            "advantage_std": MeanMetric(),
            "clip_ratio": MeanMetric(),
        }
    )


def ppo_metrics(reward_names: Iterable[str], with_kl: bool) -> MetricCollection:
    """Metrics of PPO. `loss` = `policy_loss` + `value_loss_coef` x `critic/value_loss` (each a sum of normalised
    micro-batch terms); `clip_ratio` and `critic/value_clip_ratio`: the fractions of tokens whose gradient the
    clipping took away; `critic/values` and `critic/returns`: the per-token means of the critic's values when sampled
    and of the GAE returns; `critic/explained_variance`: 1 - Var(G - V) / Var(G) over the step's tokens (1: the
    critic predicts the returns, <= 0: no better than their mean); with beta > 0 `kl`, the mean per-sequence KL
    penalised in the reward."""
    metrics = {
        **_on_policy_training_metrics(reward_names),
        "policy_loss": SumMetric(),
        "critic/value_loss": SumMetric(),
        "clip_ratio": MeanMetric(),
        "critic/value_clip_ratio": MeanMetric(),
        "critic/values": MeanMetric(),
        "critic/returns": MeanMetric(),
        "critic/explained_variance": ExplainedVariance(),
    }
    if with_kl:
        metrics["kl"] = MeanMetric()
    return _collection(metrics)


DPO_PAIR_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


def online_dpo_metrics(reward_names: Iterable[str]) -> MetricCollection:
    """Metrics of Online DPO: the rollout's rewards, the DPO pair metrics over untied pairs, `frac_tied_pairs`."""
    return _collection(
        {
            **_on_policy_training_metrics(reward_names),
            "frac_tied_pairs": MeanMetric(),
            **{name: MeanMetric() for name in DPO_PAIR_METRICS},
        }
    )


def rollout_eval_metrics(reward_names: Iterable[str]) -> MetricCollection:
    """Metrics of generating for held-out prompts (validation of rollout algorithms)."""
    return _collection(_rollout_metrics(reward_names))


def sft_metrics() -> MetricCollection:
    """Token-weighted negative log-likelihood and next-token accuracy of the completion tokens."""
    return _collection({"loss": MeanMetric(), "token_accuracy": MeanMetric(), "num_tokens": SumMetric()})


def dpo_metrics() -> MetricCollection:
    """Per-pair means (weighted by pair, padding pairs weigh 0); `logits/*` are token-weighted means of the
    vocabulary-mean logit over completion tokens."""
    names = ["loss", *DPO_PAIR_METRICS, "logits/chosen", "logits/rejected"]
    return _collection({name: MeanMetric() for name in names})


def update_rollout_metrics(
    m: MetricCollection,
    reward_names: Iterable[str],
    rewards: torch.Tensor,
    components: torch.Tensor,
    completion_mask: torch.Tensor,
    group_std: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
) -> None:
    """Update the reward and length metrics of sampled completions (training or validation): rewards [N],
    components [N, F] (one column per reward function, NaN where invalid), mask [N, T], group std [N], and a
    weight [N] per completion (0 on rows that pad a rank's share)."""
    weight = torch.ones_like(rewards) if weight is None else weight
    m["reward"].update(rewards, weight)
    m["frac_invalid_reward"].update((~torch.isfinite(components)).any(dim=1).float(), weight)
    m["reward_std"].update(group_std, weight)
    m["completion_length"].update(completion_mask.sum(dim=1), weight)
    for column, name in enumerate(reward_names):
        valid = torch.isfinite(components[:, column])  # each function's mean is over its valid values
        m[f"rewards/{name}"].update(components[:, column].nan_to_num(0.0, 0.0, 0.0), weight * valid)
