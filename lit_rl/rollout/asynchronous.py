"""Asynchronous rollouts with bounded staleness: generations made ahead of the trainer, each with its policy version.

With `max_staleness = k` and `m` optimizer steps per generation (`steps_per_generation x num_iterations`),
generation `g` (trained on at optimizer steps g*m .. g*m + m - 1) is sampled with the weights of version

    v(g) = max(0, g*m - k)          (version s = the weights after s optimizer steps)

and launched as soon as those weights exist, at the start of optimizer step v(g). So it is sampled while the
trainer runs steps v(g) .. g*m - 1, and its first update is exactly k steps newer than the policy that sampled it
(fewer in the first generations). The lag is fixed, not "whatever the engine managed": every sample is a function
of the run's seed, the generation and the weights of version v(g), so the numbers do not depend on timing, a
resumed run equals the uninterrupted one, and `k = 0` is the synchronous schedule. (In-flight weight updates,
below, give that up: where an episode takes a newer version depends on timing.) `v(g)` travels with every sample
(`RolloutBatch.policy_version`); `train/staleness/{mean,max}` log `global_step - v(g)` per consumed sample.

Engines that can generate in the background implement `AsyncRolloutEngine`: the trainer stages the weights of a
version (a collective: ZeRO-3 gathers them), submits a generation tagged with the version it must be sampled with
(a collective: the prompts go to whoever talks to the engine), and later collects it (a collective: failures reach
every rank). The engine samples each generation with exactly the version it was tagged with, one after the other;
with in-flight weight updates (`model.rollout.in_flight_updates`, episodes only) an engine that has
`take_weights_in_flight` runs the generations' episodes side by side and takes newer versions between their turns
instead (`lit_rl.rollout.in_flight`).

A checkpoint waits for the generations in flight and keeps their finished completions: the weights they were
sampled with are not in the checkpoint (only the newest are), so regenerating them on resume is impossible; the
finished samples are small next to the weights. A generation whose episodes failed is kept as its error, and a run
resumed from the checkpoint samples it again by the current weights (`lit_rl.rollout.async_episodes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence, runtime_checkable

import torch

from lit_rl.rollout.base import RolloutOutput, SamplingParams


def generation_version(generation: int, steps_per_generation: int, max_staleness: int) -> int:
    """v(g) = max(0, g*m - k): the policy version (optimizer steps done) generation g is sampled with."""
    return max(0, generation * steps_per_generation - max_staleness)


def generations_launched_at(step: int, steps_per_generation: int, max_staleness: int) -> list[int]:
    """The generations launched at the start of optimizer step `step` (those with v(g) == step), in order."""
    m, k = steps_per_generation, max_staleness
    if step == 0:
        return list(range(k // m + 1))  # every g with g*m <= k is sampled by the initial weights
    generation, remainder = divmod(step + k, m)
    return [generation] if remainder == 0 else []


class AsyncRolloutEngine(Protocol):
    """An engine that samples in the background (see the module docstring). All three calls are collectives: every
    rank makes them, in the same order, from the training thread."""

    def stage_weights(self, named_tensors: Any, version: int) -> None:
        """Take the policy's weights of `version` (every rank consumes the lazy stream) for later generations."""

    def submit(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        params: SamplingParams,
        seeds: Sequence[int],
        version: int,
    ) -> Any:
        """Start sampling this rank's prompts with the staged weights of `version`; returns a ticket."""

    def collect(self, ticket: Any) -> RolloutOutput:
        """Wait for a submitted generation; raises (on every rank) when it failed."""


@runtime_checkable
class JobEngine(AsyncRolloutEngine, Protocol):
    """An `AsyncRolloutEngine` that also runs work sampling in turns, such as episodes, in the background."""

    def submit_job(self, payload: Any, job: Callable[[list[Any]], Callable[..., list[Any]]], version: int) -> Any:
        """Start work that samples in turns (episodes) with the staged weights of `version`: every rank's `payload`
        goes to the rank that talks to the engine, where `job(payloads)` returns `work(generate)`, run in the
        background; returns a ticket (`lit_rl.rollout.engines.vllm_server.VLLMServerEngine.submit_job`). An engine
        that is also a `ConcurrentEngine` hands its `concurrent_generate` to its jobs as `generate`: many threads may
        call it at once, so the episodes go on on their own (`lit_rl.rollout.multi_turn`)."""

    def collect_job(self, ticket: Any) -> Any:
        """Wait for a submitted job: this rank's result; raises (on every rank) when it failed."""


@dataclass
class PendingGeneration:
    """A launched generation: its prompts, the version it is sampled with, and its ticket or finished output.
    Episodes (`job`): the prompts are known once their environments are reset, and come back with the
    transcripts, the environments' reward parts and the first environment error."""

    version: int
    prompt_ids: Optional[torch.Tensor]  # [N, P]
    prompt_mask: Optional[torch.Tensor]  # [N, P]
    ticket: Any = None
    output: Optional[RolloutOutput] = None
    job: bool = False
    env_rewards: Optional[torch.Tensor] = None  # [N, E], episodes only
    error: Optional[str] = None  # episodes only
    # TRL environment classes: their reward functions need the episodes' instances, so they are scored on the worker.
    reward_components: Optional[torch.Tensor] = None  # [N, F]
    rewards: Optional[torch.Tensor] = None  # [N]
    reward_error: Optional[str] = None


class AsyncGenerations:
    """The generations launched on an `AsyncRolloutEngine` ahead of the trainer, handed over in order
    (`lit_rl.rollout.producer.AsyncProducer` holds them)."""

    def __init__(self) -> None:
        self.pending: dict[int, PendingGeneration] = {}
        self.staged_version: Optional[int] = None
        # Generations whose episodes a checkpoint kept failed, by their error: sampled again when taken.
        self.failed: dict[int, str] = {}
        self.restored: set[int] = set()  # the generations the checkpoint kept: the same on every rank

    def launch(
        self,
        engine: AsyncRolloutEngine,
        generation: int,
        version: int,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        params: SamplingParams,
        seeds: Sequence[int],
        weights: Any,
    ) -> None:
        """Submit `generation`, staging the current weights (`weights()`: a lazy stream) first when the engine does
        not hold `version` yet."""
        if generation in self.pending:  # resumed: it finished before the checkpoint
            return
        self._stage(engine, version, weights)
        ticket = engine.submit(prompt_ids, prompt_mask, params, seeds, version)
        self.pending[generation] = PendingGeneration(version, prompt_ids, prompt_mask, ticket=ticket)

    def launch_job(
        self,
        engine: JobEngine,
        generation: int,
        version: int,
        payload: Any,
        job: Callable[[list[Any]], Callable[..., list[Any]]],
        weights: Any,
    ) -> None:
        """`launch` for episodes: `engine.submit_job(payload, job, version)`, whose result is this rank's
        `EpisodeResult` (`lit_rl.rollout.async_episodes`)."""
        if generation in self.pending:  # resumed: it finished before the checkpoint
            return
        self._stage(engine, version, weights)
        ticket = engine.submit_job(payload, job, version)
        self.pending[generation] = PendingGeneration(version, None, None, ticket=ticket, job=True)

    def _stage(self, engine: AsyncRolloutEngine, version: int, weights: Any) -> None:
        if self.staged_version != version:
            engine.stage_weights(weights(), version)
            self.staged_version = version

    def forget(self, generation: int) -> None:
        """Drop a restored `generation` (finished or failed), to be sampled again now."""
        self.pending.pop(generation, None)
        self.failed.pop(generation, None)

    def take(self, engine: AsyncRolloutEngine, generation: int) -> PendingGeneration:
        """The finished `generation` (waiting for it), removed from the pending ones."""
        if generation not in self.pending:
            raise RuntimeError(f"asynchronous rollouts: generation {generation} was never launched")
        item = self._finish(engine, generation)
        del self.pending[generation]
        return item

    def wait_all(self, engine: Optional[AsyncRolloutEngine]) -> None:
        """Wait for every generation in flight (before a checkpoint, or before the engine samples by the current
        weights: validation, dynamic sampling's refills)."""
        for generation in sorted(self.pending):
            self._finish(engine, generation)

    def forget_staged(self) -> None:
        """The engine's weights were replaced outside the producer (a plain push): stage again next time."""
        self.staged_version = None

    def _finish(self, engine: Optional[AsyncRolloutEngine], generation: int) -> PendingGeneration:
        item = self.pending[generation]
        if item.output is None and item.job:
            result = engine.collect_job(item.ticket)
            item.prompt_ids, item.prompt_mask, item.output = result.prompt_ids, result.prompt_mask, result.output
            item.env_rewards, item.error = result.env_rewards, result.error
            item.reward_components, item.rewards = result.reward_components, result.rewards
            item.reward_error = result.reward_error
            item.ticket = None
        elif item.output is None:
            item.output = engine.collect(item.ticket)
            item.ticket = None
        return item

    # -- checkpoints -----------------------------------------------------------------------------------------
    def state_dict(self, engine: Optional[AsyncRolloutEngine]) -> list[dict[str, Any]]:
        """This rank's launched generations, finished (waits for those in flight), as CPU tensors; one whose
        episodes failed (an environment or a TRL class's reward function raised) as its error alone: a resumed run
        samples it again instead of failing on it again (a transient failure would otherwise stop every resume)."""
        self.wait_all(engine)
        failed = dict(self.failed)
        for generation, item in self.pending.items():
            if item.error is not None or item.reward_error is not None:
                failed[generation] = item.error or item.reward_error
        finished = [
            {
                "generation": generation,
                "version": item.version,
                "prompt_ids": item.prompt_ids.cpu(),
                "prompt_mask": item.prompt_mask.cpu(),
                "completion_ids": item.output.completion_ids.cpu(),
                "completion_mask": item.output.completion_mask.cpu(),
                "logprobs": item.output.logprobs.cpu(),
                **_episode_state(item),
            }
            for generation, item in sorted(self.pending.items())
            if generation not in failed
        ]
        return finished + [{"generation": generation, "failed": error} for generation, error in sorted(failed.items())]

    def load_state_dict(self, state: list[dict[str, Any]]) -> None:
        # (A checkpoint of lit-rl 0.2 kept a failed generation whole, its error beside its transcripts.)
        failure = lambda entry: entry.get("failed") or entry.get("error") or entry.get("reward_error")  # noqa: E731
        self.failed = {entry["generation"]: failure(entry) for entry in state if failure(entry)}
        self.restored = {entry["generation"] for entry in state}
        state = [entry for entry in state if not failure(entry)]
        self.pending = {
            entry["generation"]: PendingGeneration(
                entry["version"],
                entry["prompt_ids"],
                entry["prompt_mask"],
                output=RolloutOutput(
                    entry["completion_ids"],
                    entry["completion_mask"],
                    entry["logprobs"],
                    sampled_mask=entry.get("sampled_mask"),
                    episode_stats=entry.get("episode_stats"),
                    token_versions=entry.get("token_versions"),
                ),
                job="env_rewards" in entry,
                env_rewards=entry.get("env_rewards"),
                error=entry.get("error"),
                reward_components=entry.get("reward_components"),
                rewards=entry.get("rewards"),
                reward_error=entry.get("reward_error"),
            )
            for entry in state
        }
        self.staged_version = None


def _episode_state(item: PendingGeneration) -> dict[str, Any]:
    """What a checkpoint keeps of a finished generation of episodes beyond its completions (nothing for others)."""
    if not item.job:
        return {}
    return {
        "sampled_mask": item.output.sampled_mask.cpu(),
        "episode_stats": item.output.episode_stats.cpu(),
        # in-flight weight updates: each token's version (its turn's), as the weights that sampled them are gone
        "token_versions": None if item.output.token_versions is None else item.output.token_versions.cpu(),
        "env_rewards": item.env_rewards.cpu(),
        "error": item.error,
        # TRL environment classes: their scores, as no checkpoint can keep the instances the functions read
        "reward_components": None if item.reward_components is None else item.reward_components.cpu(),
        "rewards": None if item.rewards is None else item.rewards.cpu(),
        "reward_error": item.reward_error,
    }
