"""Wall-clock accounting of a training step, logged as `perf/` metrics (not `train/`: timings differ per run)."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator, Optional

import torch

# The phases of a rollout step, in order; logged as `perf/<phase>_s` on every step. `engine_wake` (vLLM sleep
# mode) happens inside the push and the generation and is not counted in them; `engine_sleep` follows them.
PHASES = (
    "engine_start",
    "engine_wake",
    "weight_push",
    "generation",
    "engine_sleep",
    "reward",
    "old_logprobs",
    "ref_logprobs",
)


class StepTimer:
    """Accumulates named phases (generation, reward, ...) between two optimizer steps.

    Phases are exclusive: time spent in a phase opened inside another counts for the inner one only, so the
    phases add up to at most the step.

    `summary()` returns `perf/<phase>_s` for every phase, `perf/step_s` (wall time since the previous step) and
    `perf/policy_update_s` (the rest: forward/backward/optimizer of the policy), the tokens' rates and peak memory,
    then starts the next step (its phases and counters, `model_flops` among them, back to 0).
    """

    def __init__(self) -> None:
        self.phases: dict[str, float] = defaultdict(float)
        self.counters: dict[str, float] = defaultdict(float)
        self._step_start = time.perf_counter()
        self._open: list[str] = []  # phases entered and not yet left, innermost last
        self._paused_at: Optional[float] = None

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        self._open.append(name)
        try:
            yield
        finally:
            self._open.pop()
            elapsed = time.perf_counter() - start
            self.phases[name] += elapsed
            if self._open:  # the enclosing phase adds its whole duration when it ends: take this part back
                self.phases[self._open[-1]] -= elapsed

    def pause(self) -> None:
        """Stop the step's clock (validation runs between two steps and is not part of either)."""
        self._paused_at = time.perf_counter()

    def resume(self) -> None:
        if self._paused_at is not None:
            self._step_start += time.perf_counter() - self._paused_at
            self._paused_at = None

    def count(self, name: str, value: float) -> None:
        self.counters[name] += value

    def summary(self) -> dict[str, float]:
        now = time.perf_counter()
        step = now - self._step_start
        # Every phase, every step (0 when it did not happen): a key logged on some steps only would be repeated,
        # stale, by the logger on the steps in between.
        out = {f"perf/{name}_s": self.phases.get(name, 0.0) for name in (*PHASES, *self.phases)}
        out["perf/step_s"] = step
        out["perf/policy_update_s"] = max(step - sum(self.phases.values()), 0.0)
        generation = self.phases.get("generation", 0.0)
        out["perf/generated_tokens_per_s"] = self.counters["generated_tokens"] / generation if generation else 0.0
        out["perf/trained_tokens_per_s"] = self.counters["trained_tokens"] / step if step > 0 else 0.0
        out["perf/peak_memory_mib"] = peak_memory_mib()
        self.phases.clear()
        self.counters.clear()
        self._step_start = now
        return out


def peak_memory_mib(device: Optional[torch.device] = None) -> float:
    """Peak memory of this process so far: CUDA max allocated on a GPU, else the peak resident set size (RSS)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
