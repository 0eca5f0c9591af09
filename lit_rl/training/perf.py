"""Wall-clock accounting of a training step, logged as `perf/` metrics (not `train/`: timings differ per run)."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Iterator, Optional

import torch

if TYPE_CHECKING:
    from lit_rl.training.flops import RunThroughput

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
    "values",  # PPO's critic
)

# What a step counts (`StepTimer.count`), summed over ranks by `step_perf`.
COUNTERS = ("generated_tokens", "trained_tokens", "model_flops", "update_flops")


class BusyClock:
    """Seconds during which at least one request was outstanding, however many overlapped: an engine's busy time,
    counted by its client around each request (thread-safe: requests go out from many threads at once). One per
    module, made with it and given to every step timer, so it outlives them all; `perf/engine_busy_s` is logged once
    an engine counts on it (`counted`: set by the engine config that builds the engine)."""

    def __init__(self) -> None:
        self.counted = False
        self._lock = threading.Lock()
        self._outstanding = 0
        self._since = 0.0  # when the current busy stretch began (outstanding > 0)
        self._busy = 0.0  # busy seconds not yet taken

    @contextmanager
    def request(self) -> Iterator[None]:
        with self._lock:
            if self._outstanding == 0:
                self._since = time.perf_counter()
            self._outstanding += 1
        try:
            yield
        finally:
            with self._lock:
                self._outstanding -= 1
                if self._outstanding == 0:
                    self._busy += time.perf_counter() - self._since

    def take(self) -> float:
        """The busy seconds since the last `take`, a stretch still running counted up to now."""
        with self._lock:
            busy, self._busy = self._busy, 0.0
            if self._outstanding:
                now = time.perf_counter()
                busy, self._since = busy + now - self._since, now
            return busy


class StepTimer:
    """Accumulates named phases (generation, reward, ...) between two optimizer steps.

    Phases are exclusive: time spent in a phase opened inside another counts for the inner one only, so the
    phases add up to at most the step.

    `summary()` returns `perf/<phase>_s` for every phase, `perf/step_s` (wall time since the previous step) and
    `perf/policy_update_s` (the rest: forward/backward/optimizer of the policy), peak memory, and
    `perf/engine_busy_s` once an engine's client counts its requests on `engine` (the module's clock, `counted`
    by the vLLM server engine: the step's seconds with a generation request outstanding, even in the background);
    then it starts the next step (its phases and counters, `model_flops` among them, back to 0).
    """

    def __init__(self, engine: Optional[BusyClock] = None) -> None:
        self.phases: dict[str, float] = defaultdict(float)
        self.counters: dict[str, float] = defaultdict(float)
        self._step_start = time.perf_counter()
        self._open: list[str] = []  # phases entered and not yet left, innermost last
        self._paused_at: Optional[float] = None
        self.engine = engine or BusyClock()  # the module's: it outlives this timer
        self._engine_busy_s = 0.0  # taken at a pause: the step's busy time before validation
        self.engine.take()  # what ran before this timer's first step is part of none

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
        self._engine_busy_s += self.engine.take()

    def resume(self) -> None:
        if self._paused_at is not None:
            self._step_start += time.perf_counter() - self._paused_at
            self._paused_at = None
        self.engine.take()  # validation's generations: part of no step

    def count(self, name: str, value: float) -> None:
        """Add `value` to the step's counter `name`, one of `COUNTERS` (another name would never be logged)."""
        if name not in COUNTERS:
            raise ValueError(f"no step counter {name!r}: the counters are {', '.join(COUNTERS)}")
        self.counters[name] += value

    def summary(self) -> dict[str, float]:
        now = time.perf_counter()
        step = now - self._step_start
        # Every phase, every step (0 when it did not happen): a key logged on some steps only would be repeated,
        # stale, by the logger on the steps in between.
        out = {f"perf/{name}_s": self.phases.get(name, 0.0) for name in (*PHASES, *self.phases)}
        out["perf/step_s"] = step
        out["perf/policy_update_s"] = max(step - sum(self.phases.values()), 0.0)
        out["perf/peak_memory_mib"] = peak_memory_mib()
        busy, self._engine_busy_s = self._engine_busy_s + self.engine.take(), 0.0
        if self.engine.counted:
            out["perf/engine_busy_s"] = busy
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


def step_perf(
    timer: StepTimer,
    throughput: RunThroughput,
    gather: Optional[Callable[[torch.Tensor], torch.Tensor]],
    device: torch.device,
) -> dict[str, float]:
    """The step's `perf/` metrics, from this rank's `timer` (whose `summary` starts the next step's counts) and,
    with `gather` (all_gather, on several ranks), every rank's, in one collective: the slowest rank's timings and
    peak memory, since the step waits for it; the tokens' rates of all ranks together (`token_rates`); its model
    FLOP rate over all ranks, `perf/tflops`, and `perf/mfu`, that rate over the peak of the ranks' devices
    (`lit_rl.training.flops`, added to the run's `throughput`);
    `perf/update_mfu`, the same for the update alone: the forward and backward FLOPs of the passes that train (the
    policy's; PPO's critic's too) over `perf/policy_update_s`; with an engine that counts its requests (the vLLM
    server's), `perf/engine_idle_share`, the share of the step without a generation request outstanding."""
    totals = [timer.counters[name] for name in COUNTERS]
    timings = timer.summary()
    values = torch.tensor([*timings.values(), *totals], dtype=torch.float64, device=device)
    if gather is not None:
        values = gather(values)  # [world, K]: the slowest rank's timings, every rank's counts
        values = torch.cat([values[:, : -len(totals)].max(dim=0).values, values[:, -len(totals) :].sum(dim=0)])
    *slowest, generated, trained, flops, update_flops = values.tolist()
    timings = dict(zip(timings, slowest))
    timings.update(token_rates(timings, generated, trained))
    if "perf/engine_busy_s" in timings and timings["perf/step_s"] > 0:  # the share of the step it waited
        timings["perf/engine_idle_share"] = max(0.0, 1.0 - timings["perf/engine_busy_s"] / timings["perf/step_s"])
    throughput.add(timings["perf/step_s"], flops, timings.get("perf/engine_start_s", 0.0))
    timings["perf/tflops"], mfu = throughput.rates(timings["perf/step_s"], flops)
    if mfu is not None:
        timings["perf/mfu"] = mfu
        timings["perf/update_mfu"] = throughput.rates(timings["perf/policy_update_s"], update_flops)[1]
    return timings


def token_rates(timings: dict[str, float], generated: float, trained: float) -> dict[str, float]:
    """The step's tokens per second, of all ranks together (`generated`, `trained`: their sums) over the slowest
    rank's seconds (`timings`: `step_perf`'s):

        perf/generated_tokens_per_s = generated tokens / seconds of generation,
        perf/trained_tokens_per_s   = trained tokens / perf/step_s.

    The seconds of generation are `perf/engine_busy_s` with an engine that counts its requests (the vLLM server's),
    else `perf/generation_s`: under asynchronous rollouts the wait for a generation is only the part of its
    sampling the training did not hide, and tokens over it would overstate the engine's speed without bound.
    A generation's tokens count in the step that takes it, its busy seconds in the steps it was sampled in: when
    those differ (asynchronous rollouts over several optimizer steps per generation), read the rate as a mean over
    steps."""
    generation_s = timings.get("perf/engine_busy_s", timings.get("perf/generation_s", 0.0))
    step_s = timings["perf/step_s"]
    return {
        "perf/generated_tokens_per_s": generated / generation_s if generation_s > 0 else 0.0,
        "perf/trained_tokens_per_s": trained / step_s if step_s > 0 else 0.0,
    }
