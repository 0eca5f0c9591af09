"""In-flight weight updates (`model.rollout.in_flight_updates`): the engine takes a newer policy version while
episodes are running, between their turns, instead of after the last episode of a generation has ended.

Without them (`lit_rl.rollout.asynchronous`), generation g's episodes run to their end with the weights of its
version v(g), one generation after another on the engine's worker: one long episode holds back the next generation
and the next update. With them, each generation's episodes start as soon as it is launched, beside those still
running, and every turn (one `generate` call of an episode) passes through `InFlightWeights.sample`:

- when the trainer has staged a version newer than the one the engine holds, no new turn starts; the turns under
  way finish with the weights that began them; then the newest version is loaded and turns start again;
- the turn's tokens record the version that sampled them (`RolloutOutput.token_versions`), so a long episode's
  later turns carry newer versions than its first.

Why between turns, not inside one (vLLM's pause can keep a request mid-sequence): every token of a turn, with the
engine log-prob the rollout correction divides by, comes from the one version that sampled it. The cost: an update
waits for the turns under way, each at most `max_new_tokens` long (and those still queued for a server's request
slots: `lit_rl.rollout.server.pool`).

The versions staged are those the schedule launches generations with, v(g) (`lit_rl.rollout.asynchronous`): one
per generation, so with m = `steps_per_generation x num_iterations` > 1 the versions between launches never reach
the engine.

The staleness bound still holds for the oldest token of each sequence: generation g is launched, as without
in-flight updates, once the weights of v(g) exist, so its first turn is sampled by v(g) or a newer version, and
none is staler than without in-flight updates: k steps (`max_staleness`) at its generation's first optimizer step,
k + m - 1 at its last. No sequence is dropped or regenerated for being
stale. Runs with in-flight updates are not bit-reproducible: where an episode switches versions depends on timing.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Any, Callable, Optional

import torch

from lit_rl.rollout.base import Generate, RolloutOutput

# Printed once when a run turns in-flight updates on, until more seeds say whether its falls are chance.
EXPERIMENTAL = (
    "model.rollout.in_flight_updates is experimental: over three seeds of the tools job (benchmarks/tools_accuracy.py) "
    "its held-out accuracy matched the synchronous runs', but it fell mid-run in 1 of the 4 single runs the result "
    "files keep (3 of 8 with runs not kept), against none of 4 (5) with max_staleness alone (docs/environments.md)"
)


class InFlightWeights:
    """The gate every turn passes through (module docstring). `load(version)` makes the engine hold the staged
    weights of `version`; it is called with no turn under way, on the thread of the turn that found it needed.
    `staged(version)` comes from the training thread; `sample` from any number of episode threads."""

    def __init__(self, load: Callable[[int], None]) -> None:
        self._load = load
        self._changed = threading.Condition()
        self._newest: Optional[int] = None  # the newest version staged
        self._loaded: Optional[int] = None  # the version the engine holds (None: unknown, load before sampling)
        self._running = 0  # turns under way
        self._loading = False
        self._closed = False

    def staged(self, version: int) -> None:
        """The trainer staged the weights of `version`: turns started from now on wait for it to be loaded."""
        with self._changed:
            self._newest = version if self._newest is None else max(self._newest, version)
            self._changed.notify_all()

    def weights_replaced(self) -> None:
        """The engine's weights were replaced outside the staged versions (a plain push): load again first."""
        with self._changed:
            self._loaded = None

    def close(self) -> None:
        """The engine is closing: turns that would start from now on fail instead (their jobs are abandoned)."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def sample(self, generate: Generate, *args: Any, **kwargs: Any) -> RolloutOutput:
        """`generate(*args, **kwargs)` by the newest staged version, its tokens tagged with it."""
        version = self._enter()
        try:
            out = generate(*args, **kwargs)
        finally:
            with self._changed:
                self._running -= 1
                self._changed.notify_all()
        return replace(out, token_versions=torch.full_like(out.completion_ids, version))

    def _enter(self) -> int:
        """Wait until the engine holds the newest staged version (loading it when no turn is under way); then count
        this turn as under way and return that version."""
        while True:
            with self._changed:
                while not self._closed and (self._loading or (self._loaded != self._newest and self._running)):
                    self._changed.wait()
                if self._closed:
                    raise RuntimeError("in-flight weight updates: the engine was closed")
                if self._newest is None:
                    raise RuntimeError("in-flight weight updates: a turn was sampled before any weights were staged")
                if self._loaded == self._newest:
                    self._running += 1
                    return self._loaded
                self._loading, version = True, self._newest
            try:
                self._load(version)
            except BaseException:
                with self._changed:
                    self._loading = False
                    self._changed.notify_all()
                raise
            with self._changed:
                self._loaded, self._loading = version, False
                self._changed.notify_all()


def oldest_token_versions(token_versions: torch.Tensor, sampled: torch.Tensor, launched: int) -> torch.Tensor:
    """Each row's oldest version among its sampled tokens [N] (long): what `max_staleness` bounds. A row with no
    sampled token (an episode that could not start) gets `launched`, the version its generation was launched with."""
    none = torch.iinfo(torch.long).max
    versions = torch.where(sampled > 0, token_versions.long(), torch.full_like(token_versions, none, dtype=torch.long))
    oldest = versions.min(dim=1).values
    return torch.where(oldest == none, torch.full_like(oldest, launched), oldest)
