"""Write `docs/metric-reference.md` from the code: every metric each algorithm logs, with how it is reduced (the unit
each update weighs, over ranks and micro-batches) as its factory declares it (`lit_rl.training.metrics.reductions`).

    python docs/metric_reference.py            # rewrites docs/metric-reference.md
    python docs/metric_reference.py --check    # exit 1 when the committed page differs (tests/test_docs_site.py)
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from generated_page import write_or_check  # noqa: E402  (docs/ is the script's own folder)
from torchmetrics import MetricCollection

from lit_rl.algorithms.dpo import dpo_metrics
from lit_rl.algorithms.grpo import dynamic_sampling_metrics, grpo_metrics
from lit_rl.algorithms.online_dpo import online_dpo_metrics
from lit_rl.algorithms.ppo import ppo_metrics
from lit_rl.algorithms.rloo import rloo_metrics
from lit_rl.algorithms.sft import sft_metrics
from lit_rl.training.metrics import (
    DPO_PAIR_METRICS,
    asynchronous_rollout_metrics,
    data_token_budget_metrics,
    episode_metrics,
    metric_collection,
    reductions,
    rollout_correction_metrics,
    rollout_eval_metrics,
    token_budget_metrics,
)

PAGE = Path(__file__).resolve().parent / "metric-reference.md"
FN = ["<fn>"]  # one reward function, named as the pages name them: `rewards/<fn>`

ENVIRONMENT = "an environment (`model.env`)"
# What every on-policy algorithm may add to its training metrics (`OnPolicyModule.rollout_train_metrics`).
ON_POLICY_EXTRAS: list[tuple[str, Callable[[], dict]]] = [
    ("`model.rollout.max_staleness` > 0", lambda: asynchronous_rollout_metrics(False, max_lag=0)),
    ("`model.rollout.in_flight_updates` on", lambda: asynchronous_rollout_metrics(True, max_lag=0)),
    ("`model.schedule.micro_batch_tokens` set", token_budget_metrics),
    (ENVIRONMENT, episode_metrics),
]
# What DPO and SFT add with token-budget micro-batches (`OfflineModule.setup`).
DATA_TOKEN_BUDGET = ("`data.micro_batch_tokens` set", metric_collection(data_token_budget_metrics()))
# What GRPO, PPO and RLOO add with a rollout correction logged (`OnPolicyModule.logs_correction`).
CORRECTION = (
    "a rollout correction (`model.rollout.correction` not auto or none, or `max_staleness` > 0)",
    metric_collection(rollout_correction_metrics()),
)
# Algorithm -> its training collection with no option on, and what each option adds: (when, the collection with it).
ALGORITHMS: dict[str, tuple[MetricCollection, list[tuple[str, MetricCollection]]]] = {
    "GRPO": (
        grpo_metrics(FN, with_kl=False),
        [
            ("`model.loss.beta` != 0", grpo_metrics(FN, with_kl=True)),
            CORRECTION,
            ("`model.rollout.dynamic_sampling`", metric_collection(dynamic_sampling_metrics())),
        ],
    ),
    "PPO": (ppo_metrics(FN, with_kl=False), [("`model.loss.beta` != 0", ppo_metrics(FN, with_kl=True)), CORRECTION]),
    "RLOO": (rloo_metrics(FN, with_kl=False), [("`model.loss.beta` != 0", rloo_metrics(FN, with_kl=True)), CORRECTION]),
    "OnlineDPO": (online_dpo_metrics(FN), []),
    "DPO": (dpo_metrics(), [DATA_TOKEN_BUDGET]),
    "SFT": (sft_metrics(), [DATA_TOKEN_BUDGET]),
}
ON_POLICY = ("GRPO", "PPO", "RLOO", "OnlineDPO")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


# A family of metrics, one per value of s, shown once by its pattern (the factories above make its first member).
FAMILIES = {
    "train/staleness/share_0": (
        "train/staleness/share_<s>",
        "`model.rollout.max_staleness` > 0: one for each s = 0 to k + m - 1 (k: max_staleness, m: steps_per_generation "
        "x num_iterations), the share of the step's samples s steps stale",
    ),
}


# Metrics logged only where the step gives them a value to average: Online DPO's pair metrics weigh untied pairs
# alone, and a step whose pairs all tie logs none of them.
ONLY_WITH_VALUES = {
    ("OnlineDPO", f"train/{name}"): "a step with an untied pair (`train/frac_tied_pairs` < 1)"
    for name in DPO_PAIR_METRICS
}


def _table(rows: list[tuple[str, str, str]]) -> list[str]:
    lines = ["| metric | reduced as | logged |", "|---|---|---|"]
    for name, reduced, when in rows:
        name, when = FAMILIES.get(name, (name, when))
        lines.append(f"| `{name}` | {_cell(reduced)} | {_cell(when)} |")
    return lines + [""]


def _rows(prefix: str, base: MetricCollection, options: list[tuple[str, MetricCollection]]) -> list[tuple[str, ...]]:
    """(logged name, reduced as, when it is logged) of the base collection, then of what each option adds."""
    described = reductions(base.clone(prefix=prefix))
    rows = [(name, reduced, "always") for name, reduced in described.items()]
    for when, collection in options:
        added = reductions(collection.clone(prefix=prefix))
        rows += [(name, reduced, when) for name, reduced in added.items() if name not in described]
        described.update(added)
    return rows


def render() -> str:
    out = [
        "# Metric reference",
        "",
        "Every metric each algorithm's collections log (besides the step's `perf/` timings and throughput,",
        "[Speed and memory](speed-and-memory.md), and `train/skipped_steps`, the count of non-finite steps",
        "`NonFiniteGuard` with `action: skip` skipped) and how its value is reduced: the unit each update weighs",
        "(a token, a completion, a pair, an episode), over every rank and micro-batch of the optimizer step",
        "(validation: every rank and validation batch). Each is synced exactly, by summing its states over the ranks,",
        "never as a mean of per-rank or per-micro-batch means ([Metrics and logging](metrics.md)). A mean per token",
        "weighs every token the model sampled alike (in a multi-turn episode, not the environment's tokens); a mean",
        "per completion weighs every sampled completion (or transcript) alike, whatever its length. The losses that",
        "are sums add the micro-batches' terms, each already normalised over the whole step, so the sum is the step's",
        "loss.",
        "",
        "Generated from the metric factories by `python docs/metric_reference.py` (a test fails when this page and the",
        "code differ); `lit_rl.training.metrics.reductions(collection)` gives the same descriptions in code.",
        "`rewards/<fn>` stands for one column per reward function.",
        "",
    ]
    for name, (base, options) in ALGORITHMS.items():
        if name in ON_POLICY:
            options = [*options, *((when, metric_collection(make())) for when, make in ON_POLICY_EXTRAS)]
        out += [f"## {name}", "", "Training (`train/`):", ""]
        rows = _rows("train/", base, options)
        out += _table([(metric, reduced, ONLY_WITH_VALUES.get((name, metric), when)) for metric, reduced, when in rows])
        if name not in ON_POLICY:
            out += ["Validation (`val/`):", ""]
            out += _table(_rows("val/", base, []))
    out += [
        "## Validation of the rollout algorithms",
        "",
        f"{', '.join(ON_POLICY)} validate by generating for the validation prompts and scoring the completions:",
        "",
    ]
    with_episodes = [(ENVIRONMENT, metric_collection(episode_metrics()))]
    out += _table(_rows("val/", rollout_eval_metrics(FN), with_episodes))
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> None:
    write_or_check(PAGE, render, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    main()
