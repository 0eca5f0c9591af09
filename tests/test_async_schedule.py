"""Asynchronous rollouts in parts: the fixed-lag schedule, the loader's launches, the producer's bookkeeping and
checkpoint state, the rollout corrections by hand, and the settings it refuses."""

from __future__ import annotations

import math

import pytest
import torch

from lit_rl.config import RolloutArgs
from lit_rl.data.schedule import RolloutSchedule, RolloutScheduleLoader, ScheduledMicroStep
from lit_rl.errors import ConfigError
from lit_rl.losses import rollout_is_weights
from lit_rl.rollout import HFGenerate, RolloutOutput, SamplingParams, VLLMColocate
from lit_rl.rollout.asynchronous import AsyncGenerations, generation_version, generations_launched_at
from tests.conftest import grouped_kwargs


@pytest.mark.parametrize(
    "m, k, launches",
    [
        # m optimizer steps per generation, staleness k: {step: generations launched at its start}
        (1, 0, {0: [0], 1: [1], 2: [2], 3: [3]}),
        (1, 1, {0: [0, 1], 1: [2], 2: [3], 3: [4]}),
        (1, 2, {0: [0, 1, 2], 1: [3], 2: [4], 3: [5]}),
        (2, 1, {0: [0], 1: [1], 2: [], 3: [2], 4: [], 5: [3]}),
        (2, 3, {0: [0, 1], 1: [2], 2: [], 3: [3], 4: [], 5: [4]}),
    ],
)
def test_each_generation_is_launched_once_by_the_weights_k_steps_before_its_first_update(m, k, launches):
    assert {step: generations_launched_at(step, m, k) for step in launches} == launches
    for step, generations in launches.items():
        for g in generations:
            assert generation_version(g, m, k) == step
            first_update = g * m
            assert first_update - step == min(k, first_update)  # exactly k steps stale, fewer at the start


def test_the_loader_carries_the_rows_of_each_launched_generation():
    rows = [{"prompt": str(i)} for i in range(40)]
    schedule = RolloutSchedule(
        completions_per_rank=4,
        group_size=2,
        micro_steps_per_generation=4,  # 2 optimizer steps of 2 micro-steps
        start_micro_step=lambda: 0,
        micro_steps_per_optimizer_step=2,
        launches=lambda step: generations_launched_at(step, 2, 1),
    )
    loader = RolloutScheduleLoader(rows, schedule, seed=0, rank=0, world_size=1)
    items = [loader.item(i) for i in range(12)]
    launched = {i: [g for g, _ in item.launches] for i, item in enumerate(items) if item.launches}
    assert launched == {0: [0], 2: [1], 6: [2], 10: [3]}  # optimizer steps 0, 1, 3, 5
    for item in items:
        for g, launch_rows in item.launches:
            assert launch_rows == loader.rows_of_generation(g)
    # The synchronous loader's items launch nothing.
    sync = RolloutScheduleLoader(rows, RolloutSchedule(4, 2, 4, lambda: 0), seed=0, rank=0, world_size=1)
    assert sync.item(0) == ScheduledMicroStep(0, loader.rows_of_generation(0), refills=None, launches=None)


def test_rollout_corrections_by_hand():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, 0.0]])
    rollout = torch.tensor([[-1.5, -1.0, -0.5], [-1.2, -1.1, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    # d = old - rollout: row 0 (0.5, -1.0, 0.0), row 1 (0.2, 0.1, padding)
    weights, changed = rollout_is_weights("token_truncate", old, rollout, mask, cap=1.5)
    expected = [[1.5, math.exp(-1.0), 1.0], [math.exp(0.2), math.exp(0.1), 0.0]]  # e^0.5 = 1.65 > 1.5: capped
    torch.testing.assert_close(weights, torch.tensor(expected))
    assert changed.tolist() == [[True, False, False], [False, False, False]]
    # Sequence ratios: row 0 exp(0.5 - 1.0) = exp(-0.5), row 1 exp(0.3).
    weights, changed = rollout_is_weights("sequence_truncate", old, rollout, mask, cap=1.3)
    torch.testing.assert_close(weights, torch.tensor([[math.exp(-0.5)] * 3, [1.3, 1.3, 0.0]]))  # e^0.3 = 1.35 > 1.3
    assert changed.tolist() == [[False] * 3, [True, True, False]]
    # Masking keeps a sequence's ratio inside [1/C, C] and zeroes it outside: 1/1.5 = 0.67 > e^-0.5 = 0.61.
    weights, changed = rollout_is_weights("sequence_mask", old, rollout, mask, cap=1.5)
    torch.testing.assert_close(weights, torch.tensor([[0.0] * 3, [math.exp(0.3), math.exp(0.3), 0.0]]))
    assert changed.tolist() == [[True] * 3, [False] * 3]
    assert rollout_is_weights("none", old, rollout, mask, cap=1.5) == (None, None)
    with pytest.raises(ValueError, match="unknown rollout correction"):
        rollout_is_weights("token_mask", old, rollout, mask, cap=1.5)


class _RecordingEngine:
    """Finishes each generation when collected; its completion ids are the version that sampled it."""

    def __init__(self):
        self.calls = []

    def stage_weights(self, named_tensors, version):
        self.calls.append(("stage", version, list(named_tensors)))

    def submit(self, prompt_ids, prompt_mask, params, seeds, version):
        self.calls.append(("submit", version, list(seeds)))
        return version, len(prompt_ids)

    def collect(self, ticket):
        version, n = ticket
        self.calls.append(("collect", version))
        ids = torch.full((n, 2), version)
        return RolloutOutput(ids, torch.ones(n, 2), torch.zeros(n, 2))


def test_the_producer_stages_each_version_once_and_hands_generations_over_in_order():
    engine, producer = _RecordingEngine(), AsyncGenerations()
    prompts, mask, params = torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long), SamplingParams()

    def launch(generation, version):
        producer.launch(
            engine, generation, version, prompts, mask, params, [generation, generation], lambda: [("w", version)]
        )

    launch(0, 0)
    launch(1, 0)  # the same version: staged once
    assert [c[:2] for c in engine.calls] == [("stage", 0), ("submit", 0), ("submit", 0)]
    assert engine.calls[0][2] == [("w", 0)]
    assert producer.take(engine, 0).output.completion_ids.unique().tolist() == [0]
    launch(2, 1)
    # A checkpoint waits for every generation in flight and keeps them finished.
    state = producer.state_dict(engine)
    assert [(entry["generation"], entry["version"]) for entry in state] == [(1, 0), (2, 1)]
    restored = AsyncGenerations()
    restored.load_state_dict(state)
    item = restored.take(None, 2)  # finished before the checkpoint: no engine needed
    assert item.version == 1 and item.output.completion_ids.unique().tolist() == [1]
    with pytest.raises(RuntimeError, match="generation 5 was never launched"):
        restored.take(None, 5)


@pytest.mark.parametrize(
    "engine, message",
    [
        (HFGenerate(), "needs an engine that samples in the background, not HFGenerate"),
        (VLLMColocate(), "needs an engine that samples in the background, not VLLMColocate"),
    ],
)
def test_asynchronous_rollouts_refuse_engines_that_cannot_sample_beside_the_trainer(engine, message):
    from lit_rl.algorithms import GRPO

    with pytest.raises(ConfigError, match=message):
        GRPO(rollout=RolloutArgs(engine=engine, max_staleness=1))
    with pytest.raises(ConfigError, match="model.rollout.max_staleness must be >= 0"):
        GRPO(rollout=RolloutArgs(max_staleness=-1))


def test_auto_correction_is_on_with_asynchronous_rollouts():
    from lit_rl.algorithms import GRPO

    model = GRPO(**grouped_kwargs(GRPO, max_staleness=1, vllm={"mode": "server", "dtype": "float32"}))
    assert model.rollout_correction() == "token_truncate"
    assert "rollout_is_frac_corrected" in model.train_metrics and "staleness/max" in model.train_metrics
    assert "staleness/max" not in GRPO().train_metrics


def test_the_share_of_corrected_tokens_counts_the_models_tokens_alone():
    """`train/rollout_is_frac_corrected` is the share of the model's tokens whose weight the correction changed: an
    environment's observation token or a padding token is not one of them, in the numerator or the denominator
    (counting the observation, the share read 2/7)."""
    from lit_rl.algorithms import GRPO
    from lit_rl.types import RolloutBatch

    model = GRPO(rollout=RolloutArgs(correction="token_truncate", correction_cap=1.5))
    assert model.logs_correction() and model.rollout_correction() == "token_truncate"
    old = torch.full((2, 4), -1.0)
    # old - rollout = 1.0 (ratio e = 2.72, past the cap) on row 0's tokens 0 and 2 and row 1's tokens 0 and 3.
    rollout = old - torch.tensor([[1.0, 0.0, 1.0, 0.0], [1.0, 0.0, 0.0, 1.0]])
    completion_mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]])  # row 1's token 3: padding
    sampled_mask = torch.tensor([[1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]])  # row 0's token 2: an observation
    ones = torch.ones(2, dtype=torch.long)
    batch = RolloutBatch(
        prompt_ids=ones[:, None],
        prompt_mask=ones[:, None],
        completion_ids=torch.ones(2, 4, dtype=torch.long),
        completion_mask=completion_mask,
        rollout_logprobs=rollout,
        rewards=torch.zeros(2),
        reward_components=torch.zeros(2, 1),
        advantages=torch.zeros(2),
        group_reward_std=torch.zeros(2),
        sampled_mask=sampled_mask,
    )
    weights = model.rollout_importance_weights(batch, old)
    assert weights[0, 0] == weights[1, 0] == 1.5  # capped
    # The model's 6 tokens: rows 0 and 1's tokens 0, 1 and row 0's 3, row 1's 2; 2 of them corrected.
    assert model.train_metrics["rollout_is_frac_corrected"].compute().item() == pytest.approx(2 / 6)
