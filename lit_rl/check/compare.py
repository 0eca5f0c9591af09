"""How `lit-rl check` compares the two runs of a pair, and the tolerance each precision gets.

Compared:
- every logged `train/` value at every step both runs logged: it passes when |a - b| <= atol + rtol |b| (b: the
  reference side);
- the module's floating-point state after the last step, as one number: ||theta_a - theta_b|| / ||theta_b -
  theta_0||, the distance between the two runs' final weights relative to how far training moved them (theta_0:
  the weights at step 0). Element by element would not do: Adam divides each gradient by its own running
  magnitude, so an element whose gradient is rounding noise (a key projection's bias, whose exact gradient is 0)
  takes a full-size step in a noise-given direction in either run.
Not compared: `perf/` (timings) and the engine-trainer mismatch (`train/rollout_logprob_diff/*`, `train/rollout_kl`,
`train/rollout_is_ratio/*`): rounding noise around 1e-6 that differs in every layout; `train/micro_batch_tokens/max`
and `train/rank_tokens/*` (token-budget micro-batches): they describe the layout itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from lit_rl.check.runner import RunResult

WEIGHTS = "final weights, relative to the update"
IGNORED_PREFIXES = (
    "train/perf/",
    "perf/",
    "train/rollout_logprob_diff/",
    "train/rollout_kl",
    "train/rollout_is_ratio/",
    # Token-budget micro-batches describe the layout itself: the largest micro-batch, each rank's tokens.
    "train/micro_batch_tokens/",
    "train/rank_tokens/",
)


@dataclass(frozen=True)
class Tolerance:
    name: str
    rtol: float
    atol: float
    parameters: float  # the largest relative distance of the final weights (module docstring)

    def __str__(self) -> str:
        return f"{self.name}: rtol {self.rtol:g}, atol {self.atol:g}; weights {self.parameters:g}"


# fp32: the shipped configs differ by ~1e-7 relative in their metrics and ~3e-5 in their weights across layouts.
FP32 = Tolerance("fp32", 1e-5, 1e-6, 1e-3)
# bf16 keeps 8 bits of mantissa (relative rounding 2**-9 ~ 2e-3); sums over different micro-batch splits round
# differently at each step, and a few steps compound it. Weights: configs/grpo.yaml with bf16 weights moved apart by
# 0.036 (2 steps) and 0.048-0.053 (4 steps) between correct layouts, and by 0.15-0.18 with a loss normalised per
# micro-batch (`tests/integration/planted_bugs.py`): 0.08 lies between, with a margin under 2 either way.
BF16 = Tolerance("bf16", 2e-2, 2e-3, 8e-2)
FP16 = Tolerance("fp16", 5e-3, 5e-4, 2e-2)


def tolerance_for(precision: Optional[str], dtype: Optional[str], on_cpu: bool = False) -> Tolerance:
    """From `trainer.precision` and `model.policy.dtype`: the lowest precision either computes in. On a CPU
    Lightning runs `16-mixed` as `bf16-mixed` (it has no float16 autocast there): the runs compute in bfloat16."""
    if on_cpu and str(precision) in ("16-mixed", "16"):
        precision = "bf16-mixed"
    text = f"{precision or ''} {dtype or ''}".lower()
    if "bf16" in text or "bfloat16" in text:
        return BF16
    if "16" in text:
        return FP16
    return FP32


@dataclass(frozen=True)
class Difference:
    """The value that differs most, relative to what the tolerance allows: where, both values, and whether it
    passes."""

    where: str
    value: float
    reference: float
    passed: bool
    metric: str = ""  # the logged name, for a metric's difference

    @property
    def abs_diff(self) -> float:
        return abs(self.value - self.reference)


def _allowed(reference: float, tol: Tolerance) -> float:
    return tol.atol + tol.rtol * abs(reference)


def compare_rows(
    rows: list[dict[str, float]], reference: list[dict[str, float]], tol: Tolerance, steps: Optional[set[int]] = None
) -> tuple[Optional[Difference], list[str], list[str]]:
    """The worst difference over the logged values of `steps` (all of the reference's by default), what is wrong
    besides (a metric one run logs and the other does not, a metric logged twice at a step with two values, and the
    first value over the tolerance: the earliest step, where the cause shows before its consequences do), and the
    metrics NaN in both runs at some step (equal there, so not compared: the table says so)."""
    problems: list[str] = []
    by_step, mine = _by_step(reference, problems), _by_step(rows, problems)
    wanted = sorted(steps if steps is not None else by_step)
    problems += [f"step {s} not logged" for s in wanted if s not in mine or s not in by_step]
    worst: Optional[Difference] = None
    first: Optional[Difference] = None
    nan_in_both: set[str] = set()
    for step in wanted:
        if step not in mine or step not in by_step:
            continue
        a = {k: v for k, v in mine[step].items() if not k.startswith(IGNORED_PREFIXES)}
        b = {k: v for k, v in by_step[step].items() if not k.startswith(IGNORED_PREFIXES)}
        for key in sorted(set(a) ^ set(b)):
            problems.append(f"step {step}: {key} logged by one run only")
        for key in sorted(set(a) & set(b)):
            if key == "step":
                continue
            value, ref = a[key], b[key]
            nan_equal = math.isnan(value) and math.isnan(ref)
            if nan_equal:
                nan_in_both.add(key)
            excess = 0.0 if nan_equal else abs(value - ref) / _allowed(ref, tol)
            diff = Difference(f"step {step} {key}", value, ref, nan_equal or excess <= 1.0, metric=key)
            if worst is None or _excess(diff, tol) > _excess(worst, tol):
                worst = diff
            if first is None and not diff.passed:
                first = diff
    if first is not None and first is not worst:
        problems.append(f"first over tolerance: {first.where} ({first.value:.6g} vs {first.reference:.6g})")
    return worst, problems, sorted(nan_in_both)


def _by_step(rows: list[dict[str, float]], problems: list[str]) -> dict[int, dict[str, float]]:
    """Each step's values, from every row logged at it (a logger writes one row per `log_metrics` call: a callback
    logging on its own adds a row); a key two rows of one step give different values is a problem."""
    merged: dict[int, dict[str, float]] = {}
    for row in rows:
        step = merged.setdefault(int(row["step"]), {})
        for key, value in row.items():
            seen = step.setdefault(key, value)
            if key.startswith(IGNORED_PREFIXES):  # not compared: nor is a second value of it
                continue
            if seen != value and not (math.isnan(seen) and math.isnan(value)):
                problems.append(f"step {int(row['step'])}: {key} logged twice, {seen:.6g} and {value:.6g}")
    return merged


def _excess(diff: Difference, tol: Tolerance) -> float:
    """How many times the tolerance the difference is (above 1 fails)."""
    if math.isnan(diff.value) and math.isnan(diff.reference):
        return 0.0
    if math.isnan(diff.value) or math.isnan(diff.reference):
        return math.inf
    if diff.where == WEIGHTS:
        return diff.value / tol.parameters
    return diff.abs_diff / _allowed(diff.reference, tol)


# Neither run's training moved a weight. Where every reward was equal (every advantage 0) the pair cannot tell a
# correct layout from a wrong one by the weights: inconclusive (SKIP); otherwise (a skipped or broken update) FAIL.
NOT_MOVED = (
    "training moved no weight in either run (every reward equal: no advantage), so the updates could not be compared"
)
REWARD_STD = "train/reward_std"


def _rewards_all_equal(rows: list[dict[str, float]]) -> bool:
    """Whether a run logged `train/reward_std` and it was 0 at every step: every advantage 0, nothing to learn."""
    stds = [row[REWARD_STD] for row in rows if REWARD_STD in row]
    return bool(stds) and all(std == 0 for std in stds)


def compare_parameters(
    parameters: dict[str, torch.Tensor],
    reference: dict[str, torch.Tensor],
    initial: Optional[dict[str, torch.Tensor]],
    tol: Tolerance,
) -> tuple[Optional[Difference], list[str]]:
    """||parameters - reference|| / ||reference - initial|| over every floating-point tensor (module docstring)."""
    problems = [f"{name} in one run only" for name in sorted(set(parameters) ^ set(reference))]
    if initial is None:
        return None, [*problems, "no step-0 weights to measure the update by"]
    apart = moved = 0.0
    for name in sorted(set(parameters) & set(reference)):
        a, b = parameters[name], reference[name]
        if a.shape != b.shape:
            problems.append(f"{name}: shape {tuple(a.shape)} against {tuple(b.shape)}")
            continue
        apart += float(((a - b).double() ** 2).sum())
        if name in initial:
            moved += float(((b - initial[name]).double() ** 2).sum())
    if moved == 0.0:  # no update to measure a distance by: one run moved its weights, or neither did
        return None, [*problems, "the weights moved in one run only" if apart > 0 else NOT_MOVED]
    relative = math.sqrt(apart / moved)
    return Difference(WEIGHTS, relative, 0.0, relative <= tol.parameters), problems


@dataclass
class PairResult:
    """One row of the table."""

    pair: str
    compared: str
    status: str  # PASS, FAIL or SKIP
    differences: tuple[Difference, ...] = ()  # the largest of the metrics, and the weights'
    tolerance: Optional[Tolerance] = None
    detail: str = ""
    reductions: dict[str, str] = field(default_factory=dict)  # logged name -> how it is reduced (provenance)

    def largest(self) -> str:
        """The metric that differs most (with both values where it fails), and the weights' distance."""
        parts = []
        for d in self.differences:
            if d.where == WEIGHTS:
                parts.append(f"weights {d.value:.2g}")
            elif d.abs_diff == 0:
                parts.append("metrics equal")
            else:
                values = "" if d.passed else f" ({d.value:.6g} vs {d.reference:.6g})"
                reduced = self.reductions.get(d.metric)
                provenance = f" [{reduced}]" if reduced else ""
                parts.append(f"{d.abs_diff:.2g} at {d.where}{values}{provenance}")
        return "; ".join([*parts, *([self.detail] if self.detail else [])])


def judge(pair: str, left: RunResult, right: RunResult, tol: Tolerance, steps: Optional[set[int]] = None) -> PairResult:
    """PASS when every compared value of `left` is within `tol` of `right`'s and nothing is missing."""
    rows_worst, row_problems, nan_in_both = compare_rows(left.rows, right.rows, tol, steps)
    params_worst, param_problems = compare_parameters(left.parameters, right.parameters, right.initial_parameters, tol)
    problems = row_problems + param_problems
    found = tuple(d for d in (rows_worst, params_worst) if d is not None)
    failed = bool(problems) or rows_worst is None or any(not d.passed for d in found)
    inconclusive = (
        problems == [NOT_MOVED]
        and rows_worst is not None
        and rows_worst.passed
        and _rewards_all_equal(left.rows)
        and _rewards_all_equal(right.rows)
    )
    shown = sorted({int(r["step"]) for r in right.rows} if steps is None else steps)
    compared = f"steps {_span(shown)}"
    detail = "; ".join(problems[:3]) if problems else ("nothing logged" if rows_worst is None else "")
    if nan_in_both:  # equal, and so compared as nothing: said, so that a metric NaN everywhere is seen
        detail = "; ".join([*([detail] if detail else []), f"NaN in both runs: {', '.join(nan_in_both[:3])}"])
    status = "SKIP" if inconclusive else "FAIL" if failed else "PASS"
    return PairResult(pair, compared, status, found, tol, detail, {**right.reductions, **left.reductions})


def _span(steps: list[int]) -> str:
    if not steps:
        return "none"
    return f"{steps[0]}-{steps[-1]}" if len(steps) > 1 else str(steps[0])
