"""One factory per algorithm builds its MetricCollection; modules clone it per stage (`train/`, `val/`).

Every metric syncs across ranks by summing its states, so `compute()` is the exact global value: a `MeanMetric`
updated with per-token or per-sample weights gives the weighted mean over every rank and micro-batch, never a
mean of per-rank means.
"""

from __future__ import annotations

from typing import Iterable

from torchmetrics import MaxMetric, MeanMetric, MetricCollection, SumMetric


def _collection(metrics: dict) -> MetricCollection:
    # compute_groups=False: metrics are updated one by one with different values; grouping is only valid for
    # metrics that always receive the same inputs.
    return MetricCollection(metrics, compute_groups=False)


def grpo_metrics(reward_names: Iterable[str], with_kl: bool) -> MetricCollection:
    """Metrics of GRPO-style training. `loss` is a sum of micro-batch terms that are already step-normalised."""
    metrics = {
        "loss": SumMetric(),
        "reward": MeanMetric(),
        "reward_std": MeanMetric(),
        "frac_invalid_reward": MeanMetric(),
        "frac_reward_zero_std": MeanMetric(),
        "completion_length": MeanMetric(),
        "entropy": MeanMetric(),
        "clip_ratio/low": MeanMetric(),
        "clip_ratio/high": MeanMetric(),
        "rollout_logprob_diff/mean": MeanMetric(),
        "rollout_logprob_diff/max": MaxMetric(),
    }
    if with_kl:
        metrics["kl"] = MeanMetric()
    for name in reward_names:
        metrics[f"rewards/{name}"] = MeanMetric()
    return _collection(metrics)


def rloo_metrics(reward_names: Iterable[str]) -> MetricCollection:
    """Metrics of RLOO: `reward` is the task reward (before the KL penalty); `kl` the mean per-sequence KL."""
    metrics = {
        "loss": SumMetric(),
        "reward": MeanMetric(),
        "reward_std": MeanMetric(),
        "frac_invalid_reward": MeanMetric(),
        "completion_length": MeanMetric(),
        "kl": MeanMetric(),
        "advantage_std": MeanMetric(),
        "entropy": MeanMetric(),
        "clip_ratio": MeanMetric(),
        "rollout_logprob_diff/mean": MeanMetric(),
        "rollout_logprob_diff/max": MaxMetric(),
    }
    for name in reward_names:
        metrics[f"rewards/{name}"] = MeanMetric()
    return _collection(metrics)


def online_dpo_metrics(reward_names: Iterable[str]) -> MetricCollection:
    """Metrics of Online DPO: the rollout's rewards, the DPO pair metrics over untied pairs, `frac_tied_pairs`."""
    metrics = {
        "loss": SumMetric(),
        "reward": MeanMetric(),
        "reward_std": MeanMetric(),
        "frac_invalid_reward": MeanMetric(),
        "completion_length": MeanMetric(),
        "frac_tied_pairs": MeanMetric(),
        "entropy": MeanMetric(),
        "rollout_logprob_diff/mean": MeanMetric(),
        "rollout_logprob_diff/max": MaxMetric(),
    }
    for name in (
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
    ):
        metrics[name] = MeanMetric()
    for name in reward_names:
        metrics[f"rewards/{name}"] = MeanMetric()
    return _collection(metrics)


def rollout_eval_metrics(reward_names: Iterable[str]) -> MetricCollection:
    """Metrics of generating for held-out prompts (validation of rollout algorithms)."""
    metrics = {
        "reward": MeanMetric(),
        "reward_std": MeanMetric(),
        "frac_invalid_reward": MeanMetric(),
        "completion_length": MeanMetric(),
    }
    for name in reward_names:
        metrics[f"rewards/{name}"] = MeanMetric()
    return _collection(metrics)


def sft_metrics() -> MetricCollection:
    """Token-weighted negative log-likelihood and next-token accuracy of the completion tokens."""
    return _collection({"loss": MeanMetric(), "token_accuracy": MeanMetric(), "num_tokens": SumMetric()})


def dpo_metrics() -> MetricCollection:
    """Per-pair means (weighted by pair, padding pairs weigh 0); `logits/*` are token-weighted means of the
    vocabulary-mean logit over completion tokens."""
    names = [
        "loss",
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
        "logits/chosen",
        "logits/rejected",
    ]
    return _collection({name: MeanMetric() for name in names})
