"""One factory per algorithm builds its MetricCollection; modules clone it per stage (`train/`, `val/`).

Every metric syncs across ranks by summing its states (or taking their max or min), so its value is the exact global
one: a `MeanMetric` updated with per-token or per-sample weights gives the weighted mean over every rank and
micro-batch, never a mean of per-rank means. `compute_collection` does that sync for a whole collection in two
collectives (one sum, one max), where torchmetrics would run a barrier and a gather per state: dozens a step, which
cost more than the update itself once processes share cores or machines. The metrics are built with
`sync_on_compute=False` so that `compute()` itself never syncs.
"""

from __future__ import annotations

import warnings
from typing import Iterable, Optional

import torch
from torchmetrics import ExplainedVariance, MaxMetric, MeanMetric, Metric, MetricCollection, MinMetric, SumMetric
from torchmetrics.utilities.data import dim_zero_max, dim_zero_min, dim_zero_sum

from lit_rl.training.compat import state_reductions

LOCAL = {"sync_on_compute": False}  # `compute_collection` syncs; `compute()` alone must not (see the docstring)


def _collection(metrics: dict) -> MetricCollection:
    # compute_groups=False: metrics are updated one by one with different values; grouping is only valid for
    # metrics that always receive the same inputs.
    return MetricCollection(metrics, compute_groups=False)


def _rollout_metrics(reward_names: Iterable[str]) -> dict:
    """What every rollout is scored on, in training and validation: one sample each, weighted per completion."""
    metrics = {
        "reward": MeanMetric(**LOCAL),
        "reward_std": MeanMetric(**LOCAL),
        "frac_invalid_reward": MeanMetric(**LOCAL),
        "completion_length": MeanMetric(**LOCAL),
    }
    for name in reward_names:
        metrics[f"rewards/{name}"] = MeanMetric(**LOCAL)
    return metrics


def _on_policy_training_metrics(reward_names: Iterable[str]) -> dict:
    """The rollout metrics plus what every on-policy training step logs. `loss` is a sum of micro-batch terms
    that are already normalised over the step."""
    return {
        **_rollout_metrics(reward_names),
        "loss": SumMetric(**LOCAL),
        "entropy": MeanMetric(**LOCAL),
        "rollout_logprob_diff/mean": MeanMetric(**LOCAL),
        "rollout_logprob_diff/max": MaxMetric(**LOCAL),
        # Engine-trainer mismatch per sampled token: the importance ratio r = exp(trainer - engine log-prob)
        # and the k3 estimate of KL(engine || trainer), (r - 1) - log r.
        "rollout_kl": MeanMetric(**LOCAL),
        "rollout_is_ratio/min": MinMetric(**LOCAL),
        "rollout_is_ratio/mean": MeanMetric(**LOCAL),
        "rollout_is_ratio/max": MaxMetric(**LOCAL),
    }


def grpo_metrics(reward_names: Iterable[str], with_kl: bool, with_is_correction: bool = False) -> MetricCollection:
    """Metrics of GRPO-style training: the on-policy ones, the clipping, when beta > 0 the KL, and with a rollout
    correction the fraction of completion tokens whose weight it changed (truncated, or masked)."""
    metrics = {
        **_on_policy_training_metrics(reward_names),
        "frac_reward_zero_std": MeanMetric(**LOCAL),
        "clip_ratio/low": MeanMetric(**LOCAL),
        "clip_ratio/high": MeanMetric(**LOCAL),
    }
    if with_kl:
        metrics["kl"] = MeanMetric(**LOCAL)
    if with_is_correction:
        metrics["rollout_is_frac_corrected"] = MeanMetric(**LOCAL)
    return _collection(metrics)


def asynchronous_rollout_metrics() -> dict:
    """What asynchronous rollouts add: the staleness of each consumed sample, `global_step - policy_version`."""
    return {"staleness/mean": MeanMetric(**LOCAL), "staleness/max": MaxMetric(**LOCAL)}


def dynamic_sampling_metrics() -> dict:
    """What dynamic sampling adds: the refill generations a step's generation sampled, and the fraction of all the
    groups it sampled (its own and the refills') that were dropped for rewards that all agree."""
    return {"refill_generations": MeanMetric(**LOCAL), "frac_groups_dropped": MeanMetric(**LOCAL)}


def episode_metrics() -> dict:
    """What multi-turn episodes add (`lit_rl.rollout.multi_turn`), means per episode: model `turns`, `tool_calls`,
    `tool_errors` (calls that raised or timed out) and `env_tokens` (observation tokens in the transcript)."""
    return {name: MeanMetric(**LOCAL) for name in ("turns", "tool_calls", "tool_errors", "env_tokens")}


def token_budget_metrics() -> dict:
    """What token-budget micro-batches add: the real tokens of the step's largest micro-batch, across ranks (more
    than `model.micro_batch_tokens` when a step was over budget), and the most and the fewest tokens any rank
    trained on in the step (`lit_rl.training.rank_balance` deals them evenly)."""
    return {
        "micro_batch_tokens/max": MaxMetric(**LOCAL),
        "rank_tokens/max": MaxMetric(**LOCAL),
        "rank_tokens/min": MinMetric(**LOCAL),
    }


def rloo_metrics(reward_names: Iterable[str]) -> MetricCollection:
    """Metrics of RLOO: `reward` is the task reward (before the KL penalty); `kl` the mean per-sequence KL."""
    return _collection(
        {
            **_on_policy_training_metrics(reward_names),
            "kl": MeanMetric(**LOCAL),
            "advantage_std": MeanMetric(**LOCAL),
            "clip_ratio": MeanMetric(**LOCAL),
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
        "policy_loss": SumMetric(**LOCAL),
        "critic/value_loss": SumMetric(**LOCAL),
        "clip_ratio": MeanMetric(**LOCAL),
        "critic/value_clip_ratio": MeanMetric(**LOCAL),
        "critic/values": MeanMetric(**LOCAL),
        "critic/returns": MeanMetric(**LOCAL),
        "critic/explained_variance": ExplainedVariance(**LOCAL),
    }
    if with_kl:
        metrics["kl"] = MeanMetric(**LOCAL)
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
            "frac_tied_pairs": MeanMetric(**LOCAL),
            **{name: MeanMetric(**LOCAL) for name in DPO_PAIR_METRICS},
        }
    )


def rollout_eval_metrics(reward_names: Iterable[str]) -> MetricCollection:
    """Metrics of generating for held-out prompts (validation of rollout algorithms)."""
    return _collection(_rollout_metrics(reward_names))


def sft_metrics() -> MetricCollection:
    """Token-weighted negative log-likelihood and next-token accuracy of the completion tokens."""
    return _collection(
        {"loss": MeanMetric(**LOCAL), "token_accuracy": MeanMetric(**LOCAL), "num_tokens": SumMetric(**LOCAL)}
    )


def dpo_metrics() -> MetricCollection:
    """Per-pair means (weighted by pair, padding pairs weigh 0); `logits/*` are token-weighted means of the
    vocabulary-mean logit over completion tokens."""
    names = ["loss", *DPO_PAIR_METRICS, "logits/chosen", "logits/rejected"]
    return _collection({name: MeanMetric(**LOCAL) for name in names})


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


def compute_collection(collection: MetricCollection) -> dict[str, torch.Tensor]:
    """The value over every rank of each metric of `collection` that any rank updated, by name (without the prefix).

    Every rank must call it (a collective). The states of all metrics are reduced at once: the sums in one float64
    all-reduce; the maxima, the minima (negated) and whether each metric was updated, in one max all-reduce. The
    local states are left reduced: reset the collection afterwards."""
    metrics: dict[str, Metric] = dict(collection.items(keep_base=True))
    syncing = [name for name, metric in metrics.items() if metric.sync_on_compute]
    if syncing:  # its compute() would sum the states this function already summed: every rank's value, world times
        raise TypeError(
            f"metric {syncing[0]!r} must be built with lit_rl.training.metrics.LOCAL (sync_on_compute=False)"
        )
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return {name: metric.compute() for name, metric in metrics.items() if metric.update_called}
    device = next(t.device for m in metrics.values() for t in m.metric_state.values() if torch.is_tensor(t))
    packs: dict[str, list[torch.Tensor]] = {"sum": [], "max": []}

    def add(pack: str, values: torch.Tensor) -> int:
        packs[pack].append(values.detach().reshape(-1).to(torch.float64))
        return len(packs[pack]) - 1

    flags, places = [], []  # (name, index of its updated flag); (metric, state, kind, index, shape, dtype)
    for name, metric in metrics.items():
        flags.append((name, add("max", torch.tensor([float(metric.update_called)], device=device))))
        for state, reduce in state_reductions(metric).items():  # each state's `dist_reduce_fx`
            value = getattr(metric, state)
            kind = {dim_zero_sum: "sum", dim_zero_max: "max", dim_zero_min: "min"}.get(reduce)
            if kind is None or not torch.is_tensor(value):
                raise TypeError(f"{type(metric).__name__}.{state}: only sum, max and min tensor states can be synced")
            index = add("sum" if kind == "sum" else "max", -value if kind == "min" else value)
            places.append((metric, state, kind, index, value.shape, value.dtype))
    reduced = {}
    for pack, op in (("sum", torch.distributed.ReduceOp.SUM), ("max", torch.distributed.ReduceOp.MAX)):
        if packs[pack]:
            flat = torch.cat(packs[pack])
            torch.distributed.all_reduce(flat, op=op)
            reduced[pack] = torch.split(flat, [len(values) for values in packs[pack]])
    for metric, state, kind, index, shape, dtype in places:
        value = reduced["sum" if kind == "sum" else "max"][index]
        setattr(metric, state, (-value if kind == "min" else value).reshape(shape).to(dtype))
    updated = [name for name, flag in flags if reduced["max"][flag].item() > 0]
    with warnings.catch_warnings():  # updated on another rank only: torchmetrics warns of compute before update
        warnings.filterwarnings("ignore", message=".*was called before the ``update`` method.*")
        return {name: metrics[name].compute() for name in updated}
