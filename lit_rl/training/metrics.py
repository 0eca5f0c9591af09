"""The metrics every algorithm shares, and their exact sync across ranks. Each algorithm's own factory lives with it
(`grpo_metrics` in `lit_rl/algorithms/grpo.py`, ...) and builds its MetricCollection from these; modules clone it per
stage (`train/`, `val/`).

Every metric syncs across ranks by summing its states (or taking their max or min), so its value is the exact global
one: a `MeanMetric` updated with per-token or per-sample weights gives the weighted mean over every rank and
micro-batch, never a mean of per-rank means. `compute_collection` does that sync for a whole collection in two
collectives (one sum, one max), where torchmetrics would run a barrier and a gather per state: dozens a step, which
cost more than the update itself once processes share cores or machines. The metrics are built with
`sync_on_compute=False` so that `compute()` itself never syncs.

What differs from one metric to another is the weight each update gives: every metric is built by a constructor that
declares it (`mean("token")`, `total(...)`, `largest(...)`, `smallest(...)`, `explained_variance(...)`), and
`reductions` names, for each logged metric, how it is reduced (`docs/metric-reference.md` lists them all).
"""

from __future__ import annotations

import warnings
from typing import Any, Iterable, Optional

import torch
from torchmetrics import ExplainedVariance, MaxMetric, MeanMetric, Metric, MetricCollection, MinMetric, SumMetric
from torchmetrics.utilities.data import dim_zero_max, dim_zero_min, dim_zero_sum

from lit_rl.ops import kl_k3
from lit_rl.training.compat import state_reductions
from lit_rl.types import EPISODE_STATS, RolloutBatch, model_token_mask

LOCAL = {"sync_on_compute": False}  # `compute_collection` syncs; `compute()` alone must not (see the docstring)


# -- torchmetrics' aggregators, keeping NaN -------------------------------------------------------------------------
# Theirs drop NaN values (with one warning; `nan_strategy="disable"` drops the weights too), so a step with one NaN
# micro-batch loss logged the mean of the rest, and check for them with a host-device sync at every update. These
# are the same sums, with NaN kept: the step's value is NaN.
def _as_values(metric: Metric, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        value = torch.as_tensor(value, dtype=metric.dtype, device=metric.device)
    return value.to(metric.dtype)


class Mean(MeanMetric):
    """sum_i w_i x_i / sum_i w_i over every update (`MeanMetric`, NaN kept)."""

    def update(self, value: Any, weight: Any = None) -> None:
        value = _as_values(self, value)
        weight = torch.ones_like(value) if weight is None else _as_values(self, weight)
        weight = torch.broadcast_to(weight, value.shape)
        if value.numel():
            self.mean_value += (value * weight).sum()
            self.weight += weight.sum()


class Sum(SumMetric):
    """sum_i x_i over every update (`SumMetric`, NaN kept)."""

    def update(self, value: Any) -> None:
        value = _as_values(self, value)
        if value.numel():
            self.sum_value += value.sum()


class Max(MaxMetric):
    """max_i x_i over every update (`MaxMetric`, NaN kept)."""

    def update(self, value: Any) -> None:
        value = _as_values(self, value)
        if value.numel():
            self.max_value = torch.max(self.max_value, torch.max(value))


class Min(MinMetric):
    """min_i x_i over every update (`MinMetric`, NaN kept)."""

    def update(self, value: Any) -> None:
        value = _as_values(self, value)
        if value.numel():
            self.min_value = torch.min(self.min_value, torch.min(value))


# -- metrics that declare how they are reduced -----------------------------------------------------------------------
# Each sets `reduced_as` on the metric: the unit one update's weight counts (a token, a completion, a pair, ...). The
# metric itself is a torchmetrics aggregator (NaN kept), built with LOCAL: the attribute changes no value.
def _declared(metric: Metric, reduced_as: str) -> Metric:
    metric.reduced_as = reduced_as
    return metric


def mean(unit: str) -> MeanMetric:
    """A mean in which each `unit` (token, completion, pair, episode, ...) weighs the same: what its updates pass,
    one value per unit (or that unit's weight)."""
    return _declared(Mean(**LOCAL), f"mean per {unit}")


def total(what: str) -> SumMetric:
    """A sum of `what` (the step's micro-batch losses, its tokens, ...)."""
    return _declared(Sum(**LOCAL), f"sum of {what}")


def largest(unit: str) -> MaxMetric:
    """The largest value of any `unit` (token, completion, micro-batch, rank)."""
    return _declared(Max(**LOCAL), f"max of any {unit}")


def smallest(unit: str) -> MinMetric:
    """The smallest value of any `unit`."""
    return _declared(Min(**LOCAL), f"min of any {unit}")


def explained_variance(unit: str) -> ExplainedVariance:
    """1 - Var(target - prediction) / Var(target), one sample per `unit`."""
    return _declared(ExplainedVariance(**LOCAL), f"explained variance, one sample per {unit}")


def reductions(collection: MetricCollection) -> dict[str, str]:
    """Each metric's logged name (with the collection's prefix: `train/entropy`) -> how its value is reduced, on one
    line: "mean per token, over ranks and micro-batches". A metric built without a declaration says so."""
    validation = (collection.prefix or "").startswith("val")
    scope = "over ranks and validation batches" if validation else "over ranks and micro-batches"
    described = {}
    for name, metric in collection.items(keep_base=False):
        declared = getattr(metric, "reduced_as", None)
        described[name] = f"{declared}, {scope}" if declared else f"{type(metric).__name__}: reduction not declared"
    return described


def metric_collection(metrics: dict) -> MetricCollection:
    # compute_groups=False: metrics are updated one by one with different values; grouping is only valid for
    # metrics that always receive the same inputs.
    return MetricCollection(metrics, compute_groups=False)


def _rollout_metrics(reward_names: Iterable[str]) -> dict:
    """What every rollout is scored on, in training and validation: one sample each, weighted per completion
    (`reward_std`: the std of the completion's group; `rewards/<fn>`: over the completions the function scored)."""
    metrics = {
        "reward": mean("completion"),
        "reward_std": mean("completion"),
        "frac_invalid_reward": mean("completion"),
        "completion_length": mean("completion"),
    }
    for name in reward_names:
        metrics[f"rewards/{name}"] = mean("completion")
    return metrics


def on_policy_training_metrics(reward_names: Iterable[str]) -> dict:
    """The rollout metrics plus what every on-policy training step logs. `loss` is a sum of micro-batch terms
    that are already normalised over the step."""
    return {
        **_rollout_metrics(reward_names),
        "loss": total("step-normalised micro-batch losses"),
        "entropy": mean("token"),
        "rollout_logprob_diff/mean": mean("token"),
        "rollout_logprob_diff/max": largest("token"),
        # Engine-trainer mismatch per sampled token: the importance ratio r = exp(trainer - engine log-prob)
        # and the k3 estimate of KL(engine || trainer), (r - 1) - log r.
        "rollout_kl": mean("token"),
        "rollout_is_ratio/min": smallest("token"),
        "rollout_is_ratio/mean": mean("token"),
        "rollout_is_ratio/max": largest("token"),
    }


def asynchronous_rollout_metrics(in_flight_updates: bool, max_lag: int) -> dict:
    """What asynchronous rollouts add: the staleness of each consumed sample, `global_step - policy_version` (with
    in-flight weight updates, its oldest token's), its histogram (`staleness/share_<s>`: the share of the step's
    samples s steps stale, for s = 0 to `max_lag`, the most there can be: k + m - 1 with `max_staleness` k and m
    optimizer steps a generation), and with in-flight updates the mean staleness of the model's tokens, each by the
    version that sampled it (`staleness/token_mean`, lower than `staleness/mean` when episodes took newer weights
    between their turns)."""
    metrics = {"staleness/mean": mean("completion"), "staleness/max": largest("completion")}
    metrics |= {f"staleness/share_{lag}": mean("completion") for lag in range(max_lag + 1)}
    if in_flight_updates:
        metrics["staleness/token_mean"] = mean("token")
    return metrics


def episode_metrics() -> dict:
    """What multi-turn episodes add (`lit_rl.rollout.multi_turn`), means per episode: model `turns`, `tool_calls`,
    `tool_errors` (calls that raised or timed out), `env_tokens` (observation tokens in the transcript) and
    `env_timeouts` (environment steps past `model.env.step_timeout_s`, each ending its episode)."""
    return {name: mean("episode") for name in EPISODE_STATS}


def rollout_correction_metrics() -> dict:
    """What a rollout correction adds where it is logged (`OnPolicyModule.logs_correction`): the share of the
    model's tokens whose weight it changed (`lit_rl.losses.rollout_is_weights`)."""
    return {"rollout_is_frac_corrected": mean("token")}


def token_budget_metrics() -> dict:
    """What token-budget micro-batches add: the real tokens of the step's largest micro-batch, across ranks (more
    than `model.schedule.micro_batch_tokens` when a step was over budget), and the most and the fewest tokens any rank
    trained on in the step (`lit_rl.training.rank_balance` deals them evenly)."""
    return {
        "micro_batch_tokens/max": largest("micro-batch"),
        "rank_tokens/max": largest("rank"),
        "rank_tokens/min": smallest("rank"),
    }


def data_token_budget_metrics() -> dict:
    """What DPO's and SFT's token-budget micro-batches (`data.micro_batch_tokens`) add: the real (prompt and
    completion) tokens of the step's largest micro-batch, across ranks; more than the budget when a step's items did
    not fit in its micro-batches (`lit_rl.training.micro_batches`)."""
    return {"micro_batch_tokens/max": largest("micro-batch")}


DPO_PAIR_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


def rollout_eval_metrics(reward_names: Iterable[str]) -> MetricCollection:
    """Metrics of generating for held-out prompts (validation of rollout algorithms)."""
    return metric_collection(_rollout_metrics(reward_names))


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


def half_precision_states(metric: Metric) -> list[str]:
    """The states of `metric` held in float16 or bfloat16 (its `dtype` says only what it was last moved with)."""
    return [
        name
        for name, value in metric.metric_state.items()
        if torch.is_tensor(value) and value.dtype in (torch.float16, torch.bfloat16)
    ]


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
    halved = [(name, state) for name, metric in metrics.items() for state in half_precision_states(metric)]
    if halved:  # its sums would round: 300 updates of 7 tokens count 2048 in bfloat16
        (name, state), dtype = halved[0], getattr(metrics[halved[0][0]], halved[0][1]).dtype
        raise TypeError(
            f"metric {name!r} accumulates in {dtype} ({state}): metric states must stay float32 (a module cast "
            "with `.to(dtype)` keeps them so: `PolicyModule._apply`)"
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


def update_episode_metrics(metrics: Any, stats: Optional[torch.Tensor], weight: Optional[torch.Tensor] = None) -> None:
    """Each episode's `EPISODE_STATS` [N, 5] into the collection's metrics of the same names (means per episode;
    `weight` [N]: 0 on rows that pad a rank's share). Nothing without episodes (`stats` None)."""
    if stats is None:
        return
    weight = torch.ones_like(stats[:, 0]) if weight is None else weight
    for column, name in enumerate(EPISODE_STATS):
        metrics[name].update(stats[:, column], weight)


def update_on_policy_metrics(
    metrics: Any,
    reward_names: list[str],
    mb: RolloutBatch,
    entropy: torch.Tensor,
    fresh_logprobs: Optional[torch.Tensor],
    global_step: int,
    max_lag: Optional[int],
) -> None:
    """Update the training metrics every on-policy algorithm logs (`on_policy_training_metrics`, and those of
    asynchronous rollouts and episodes) with a micro-batch `mb`: its rewards, episodes and entropy; the engine's
    log-probs against the trainer's (`mb.old_logprobs` when computed at generation time, else `fresh_logprobs`,
    this first on-policy pass's; None on later passes), at the same weights when synchronous (with asynchronous
    rollouts the trainer's weights are up to the sample's staleness newer, and the gap holds that change too); with
    asynchronous rollouts (`max_lag`, the stalest lag a sample can have; None: synchronous) each sample's
    staleness at optimizer step `global_step + 1`."""
    m = metrics
    model_tokens = model_token_mask(mb)
    tokens = model_tokens > 0  # [n, T]: observation tokens count in no token metric
    if max_lag is not None:
        staleness = (global_step - mb.policy_version).float()  # [n] optimizer steps
        m["staleness/mean"].update(staleness)
        m["staleness/max"].update(staleness)
        for lag in range(max_lag + 1):  # the histogram: each sample counts in one share
            m[f"staleness/share_{lag}"].update((staleness == lag).float())
    if mb.token_versions is not None:  # in-flight updates: each model token by the version that sampled it
        m["staleness/token_mean"].update((global_step - mb.token_versions[tokens]).float())
    update_rollout_metrics(m, reward_names, mb.rewards, mb.reward_components, model_tokens, mb.group_reward_std)
    update_episode_metrics(m, mb.episode_stats)
    m["entropy"].update(entropy[tokens])
    trainer_logprobs = mb.old_logprobs if mb.old_logprobs is not None else fresh_logprobs
    if trainer_logprobs is not None:
        log_ratio = (trainer_logprobs.detach() - mb.rollout_logprobs)[tokens]
        m["rollout_logprob_diff/mean"].update(log_ratio.abs())
        m["rollout_logprob_diff/max"].update(log_ratio.abs())
        m["rollout_kl"].update(kl_k3(mb.rollout_logprobs[tokens], trainer_logprobs.detach()[tokens]))
        ratio = torch.exp(log_ratio)
        for stat in ("min", "mean", "max"):
            m[f"rollout_is_ratio/{stat}"].update(ratio)
