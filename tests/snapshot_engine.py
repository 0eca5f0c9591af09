"""An `AsyncRolloutEngine` for tests that need no vLLM: HF `generate` on a copy of the policy, in a worker thread,
loading for each generation the weights staged for its version. It records what it did, so tests can check that
every generation was sampled with the weights of the step it was tagged with. With in-flight weight updates
(`take_weights_in_flight`) its jobs run side by side and load each staged version between turns, through lit-rl's
own gate (`lit_rl.rollout.in_flight`)."""

from __future__ import annotations

import copy
import functools
import hashlib
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterable, Optional, Sequence

import torch

from lit_rl.rollout import HFGenerateEngine, RolloutOutput, SamplingParams
from lit_rl.rollout.in_flight import InFlightWeights


def weights_digest(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """A hash of the weights' names and bytes: equal digests mean equal weights."""
    digest = hashlib.sha256()
    for name, tensor in sorted(named_tensors, key=lambda item: item[0]):
        digest.update(name.encode())
        digest.update(tensor.detach().to(torch.float32).cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


class SnapshotEngine:
    needs_weights = True

    def __init__(self, policy: torch.nn.Module, eos_token_ids: Sequence[int], pad_token_id: int) -> None:
        self.model = copy.deepcopy(policy)
        self.inner = HFGenerateEngine(self.model, eos_token_ids, pad_token_id)
        self.staged: dict[int, dict[str, torch.Tensor]] = {}
        self.staged_digests: dict[int, str] = {}
        self.generated_versions: list[int] = []  # in the order the worker sampled them
        self.submitted = 0  # generations and jobs submitted so far
        self.sync_pushes: list[tuple[int, str]] = []  # (generations submitted before it, digest) per plain push
        self.worker = ThreadPoolExecutor(max_workers=1)
        self.in_flight: Optional[InFlightWeights] = None
        self.loaded_versions: list[int] = []  # in-flight: the versions the gate loaded, in order
        self._one_generate = threading.Lock()  # HF generate on one model copy: one call at a time

    def _load(self, weights: dict[str, torch.Tensor]) -> None:
        missing, unexpected = self.model.load_state_dict(weights, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)

    def stage_weights(self, named_tensors, version: int) -> None:
        weights = {name: tensor.detach().clone().cpu() for name, tensor in named_tensors}
        self.staged[version] = weights
        self.staged_digests[version] = weights_digest(weights.items())
        if self.in_flight is not None:
            self.in_flight.staged(version)

    def take_weights_in_flight(self) -> None:
        if self.in_flight is None:
            self.in_flight = InFlightWeights(self._load_version)
            self.worker = ThreadPoolExecutor(max_workers=4)  # asked for before the first job

    def _load_version(self, version: int) -> None:
        self._load(self.staged[version])
        self.loaded_versions.append(version)

    def _generate_alone(self, *args, **kwargs) -> RolloutOutput:
        with self._one_generate:
            return self.inner.generate(*args, **kwargs)

    def submit(self, prompt_ids, prompt_mask, params: SamplingParams, seeds, version: int) -> Future:
        self.submitted += 1
        return self.worker.submit(self._generate, self.staged[version], prompt_ids, prompt_mask, params, seeds, version)

    def _generate(self, weights, prompt_ids, prompt_mask, params, seeds, version) -> RolloutOutput:
        self._load(weights)
        self.generated_versions.append(version)
        return self.inner.generate(prompt_ids, prompt_mask, params, seeds)

    def collect(self, ticket: Future) -> RolloutOutput:
        return ticket.result()

    def submit_job(self, payload, job, version: int) -> Future:
        self.submitted += 1
        work = job([payload])  # one rank: its own payload, prepared on the calling thread as the server engine does
        if self.in_flight is not None:
            return self.worker.submit(work, functools.partial(self.in_flight.sample, self._generate_alone))
        return self.worker.submit(self._run_job, self.staged[version], work, version)

    def _run_job(self, weights, work, version):
        self._load(weights)
        self.generated_versions.append(version)
        return work(self.inner.generate)

    def collect_job(self, ticket: Future):
        (result,) = ticket.result()
        return result

    # the synchronous interface, which validation uses
    def generate(self, prompt_ids, prompt_mask, params, seeds=None) -> RolloutOutput:
        return self.inner.generate(prompt_ids, prompt_mask, params, seeds)

    def update_weights(self, named_tensors=None) -> None:
        weights = {name: tensor.detach().clone().cpu() for name, tensor in named_tensors}
        self.sync_pushes.append((self.submitted, weights_digest(weights.items())))
        self._load(weights)
        if self.in_flight is not None:
            self.in_flight.weights_replaced()

    def close(self) -> None:
        self.worker.shutdown(wait=True)


def use_snapshot_engine(module) -> list[SnapshotEngine]:
    """Make `module` (an on-policy algorithm) build a `SnapshotEngine` instead of its configured one; the list
    receives each engine built."""
    from lit_rl.modeling.models import model_eos_token_ids

    built: list[SnapshotEngine] = []

    def build():
        eos = model_eos_token_ids(module.policy, module.tokenizer.eos_token_id)
        built.append(SnapshotEngine(module.policy, eos, module.tokenizer.pad_token_id))
        return built[-1]

    module.engines.build = build
    return built
