"""Asynchronous rollouts end to end on the tiny model: `max_staleness: 0` logs what the synchronous schedule
logged before asynchrony existed; with k >= 1 every generation is sampled by the weights of the step it is tagged
with, no consumed sample is staler than k, checkpoints land on the cadence, and a run resumed from a checkpoint
taken with generations in flight logs the same numbers. The engine is `tests.snapshot_engine` (HF generate on a
copy of the policy, in a worker thread); the vLLM server's own tests are in test_vllm.py."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lit_rl.algorithms import GRPO, RLOO
from lit_rl.config import RolloutArgs
from lit_rl.data import PromptDataModule
from lit_rl.errors import ConfigError
from lit_rl.rollout.base import unpadded_prompts
from lit_rl.types import model_token_mask
from tests.conftest import assert_rows_match, grouped_kwargs, train_rows, without_engine_gap
from tests.golden.sync_schedule import GOLDEN, RUNS, run
from tests.snapshot_engine import use_snapshot_engine, weights_digest

pytestmark = pytest.mark.slow

ASYNCHRONOUS_ONLY = ("train/staleness/", "train/rollout_is_frac_corrected")  # metrics a synchronous run has not


@pytest.mark.parametrize("name", sorted(RUNS))
def test_max_staleness_zero_logs_what_the_synchronous_schedule_logged(tmp_path, name):
    # The golden rows were written by the code before asynchronous rollouts (tests/golden/sync_schedule.py), on
    # another CPU: its float32 kernels (AVX2 there, AVX-512 here) round the last bits otherwise. The sampled tokens
    # and so the rewards agree exactly; the losses, KL and entropy within 1e-4 of themselves (1.5e-5 measured);
    # the engine-vs-trainer gap, rounding noise of about 1e-6 in every layout, within 1e-5.
    rows, golden = run(name, tmp_path), json.loads(GOLDEN.read_text())[name]
    rewards = [{k: v for k, v in row.items() if k == "step" or "reward" in k} for row in rows]
    expected = [{k: v for k, v in row.items() if k == "step" or "reward" in k} for row in golden]
    assert_rows_match(rewards, expected, rel=0, abs=0)
    assert_rows_match(without_engine_gap(rows), without_engine_gap(golden), rel=1e-4, abs=1e-6)
    assert_rows_match(rows, golden, rel=0, abs=1e-5)


class PolicyDigests(Callback):
    """The digest of the policy's weights at each optimizer step's start (version = global_step)."""

    def __init__(self):
        self.by_version: dict[int, str] = {}

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.by_version.setdefault(trainer.global_step, weights_digest(module.policy.state_dict().items()))


class BufferVersions(Callback):
    """The policy version of every row of the buffer each optimizer step trained on, by step (global_step before it)."""

    def __init__(self):
        self.by_step: dict[int, list[int]] = {}

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.step = trainer.global_step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.by_step.setdefault(self.step, module._buffer.policy_version.tolist())


def _fit(
    tmp_path: Path,
    name: str,
    max_steps: int,
    ckpt_path=None,
    every_n=None,
    algorithm=GRPO,
    callbacks=(),
    **model_args,
):
    args = dict(num_generations=4, micro_batch_size=8, max_new_tokens=4, vllm={"mode": "server"})
    model = algorithm(**grouped_kwargs(algorithm, **{**args, **model_args}))
    engines = use_snapshot_engine(model)
    digests = PolicyDigests()
    callbacks = [digests, *callbacks]
    if every_n:
        callbacks.append(
            ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", every_n_train_steps=every_n, save_top_k=-1)
        )
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        logger=CSVLogger(tmp_path, name=name, version=0),
        log_every_n_steps=1,
        enable_checkpointing=bool(every_n),
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=callbacks,
    )
    L.seed_everything(0)
    trainer.fit(model, PromptDataModule(val_data=None), ckpt_path=ckpt_path, weights_only=False)  # our own
    return tmp_path / name / "version_0", engines, digests


@pytest.mark.parametrize("k, steps_per_generation", [(1, 1), (2, 1), (1, 2)])
def test_every_generation_is_sampled_by_the_weights_it_is_tagged_with_and_no_sample_is_staler_than_k(
    tmp_path, k, steps_per_generation
):
    max_steps = 6
    log_dir, engines, digests = _fit(
        tmp_path, "run", max_steps, max_staleness=k, steps_per_generation=steps_per_generation
    )
    (engine,) = engines
    # The weights staged for version v are the policy's after v optimizer steps, and the worker sampled the
    # generations in order with non-decreasing versions.
    for version, digest in engine.staged_digests.items():
        assert digest == digests.by_version[version], version
    assert engine.generated_versions == sorted(engine.generated_versions)
    rows = train_rows(log_dir)
    assert [row["step"] for row in rows] == list(range(1, max_steps + 1))  # logged with the step's number
    for row in rows:
        step = int(row["step"]) - 1  # the optimizer steps done before this one: the trained policy's version
        # Generation g = step // m was sampled by version max(0, g*m - k); later steps of a generation add their
        # offset within it, as in the synchronous schedule.
        m = steps_per_generation
        expected = step - max(0, (step // m) * m - k)
        assert row["train/staleness/max"] == expected and row["train/staleness/mean"] == expected
        assert row["train/staleness/max"] <= k + m - 1
        # The histogram: every sample of the step is `expected` steps stale, and each lag up to k + m - 1 is logged.
        shares = [row[f"train/staleness/share_{lag}"] for lag in range(k + m)]
        assert shares == [float(lag == expected) for lag in range(k + m)], (row["step"], shares)
    assert max(row["train/staleness/max"] for row in rows if (int(row["step"]) - 1) % steps_per_generation == 0) == k
    assert all(0 <= row["train/rollout_is_frac_corrected"] <= 1 for row in rows)


def test_resume_from_a_checkpoint_taken_with_generations_in_flight_logs_the_same_numbers(tmp_path):
    args = dict(max_staleness=2)
    full_dir, _, _ = _fit(tmp_path / "full", "run", 6, every_n=2, **args)
    assert saved_steps_in(tmp_path / "full" / "ckpt") == [2, 4, 6]
    pending = _pending_at_step_2(tmp_path)
    # After 2 steps (k = 2): generations 0 and 1 were trained on; 2 (version 0) and 3 (version 1) were in flight.
    assert [(entry["generation"], entry["version"]) for entry in pending] == [(2, 0), (3, 1)]
    resumed_dir, engines, _ = _resumed_from_step_2(tmp_path, 6, **args)
    assert saved_steps_in(tmp_path / "resumed" / "ckpt") == [4, 6]
    # Generations 2 and 3 came from the checkpoint: the resumed engine sampled generations 4-7 (versions 2-5).
    assert engines[0].generated_versions == [2, 3, 4, 5]
    assert_rows_match(train_rows(resumed_dir), train_rows(full_dir), rel=0, abs=0)


def _resumed_from_step_2(tmp_path: Path, max_steps: int, **args):
    """`_fit` resumed from the `full` run's checkpoint at step 2 (every 2 steps), into `resumed`."""
    checkpoint = tmp_path / "full" / "ckpt" / "step=2.ckpt"
    return _fit(tmp_path / "resumed", "run", max_steps, ckpt_path=checkpoint, every_n=2, **args)


def _pending_at_step_2(tmp_path: Path) -> list[dict]:
    """The generations in flight that the `full` run's checkpoint at step 2 kept (its rank's `pending`)."""
    checkpoint = torch.load(tmp_path / "full" / "ckpt" / "step=2.ckpt", weights_only=False)
    return checkpoint["lit_rl"]["per_rank"][0]["pending"]


def saved_steps_in(directory: Path) -> list[int]:
    return sorted(int(p.stem.split("=")[1]) for p in directory.glob("step=*.ckpt"))


def test_rloo_trains_with_asynchronous_rollouts(tmp_path):
    log_dir, engines, _ = _fit(tmp_path, "rloo", 3, algorithm=RLOO, max_staleness=1)
    rows = train_rows(log_dir)
    assert [row["train/staleness/max"] for row in rows] == [0.0, 1.0, 1.0]
    assert engines[0].generated_versions == [0, 0, 1, 2]
    # Its loss is per sequence, so is its correction: each sequence's term weighed by its truncated ratio.
    assert all(0.0 <= row["train/rollout_is_frac_corrected"] <= 1.0 for row in rows)
    model = RLOO(**grouped_kwargs(RLOO, max_staleness=1, vllm={"mode": "server"}))
    assert model.rollout_correction() == "sequence_truncate"
    with pytest.raises(ConfigError, match="model.rollout.correction token_truncate: RLOO's loss is per sequence"):
        RLOO(rollout=RolloutArgs(correction="token_truncate"))


def test_episodes_are_sampled_ahead_by_the_weights_they_are_tagged_with_and_resume_to_the_same_numbers(tmp_path):
    """Multi-turn episodes (`model.env`) with k = 1: each generation's episodes run on the engine's worker with the
    staged weights of its version, every turn of them; the first generation's episodes (version 0, the same seeds)
    are the synchronous run's; a checkpoint taken with episodes in flight keeps their transcripts, and the resumed
    run logs the same numbers."""
    episodes = dict(environment="tests.integration.envs.Countdown", max_turns=3, max_new_tokens=3)
    sync_dir, _, _ = _fit(tmp_path / "sync", "run", 1, **episodes)
    full_dir, engines, digests = _fit(tmp_path / "full", "run", 4, every_n=2, max_staleness=1, **episodes)
    (engine,) = engines
    for version, digest in engine.staged_digests.items():
        assert digest == digests.by_version[version], version
    assert engine.generated_versions == [0, 0, 1, 2, 3]  # generation g by version max(0, g - 1); 4 launched at step 3
    rows = train_rows(full_dir)
    assert [row["train/staleness/max"] for row in rows] == [0.0, 1.0, 1.0, 1.0]
    for row in rows:  # Countdown: 3 model turns, observations between
        assert row["train/turns"] > 1 and row["train/env_tokens"] > 0, row
    (sync_row,) = train_rows(sync_dir)
    first = {key: value for key, value in rows[0].items() if not key.startswith(ASYNCHRONOUS_ONLY)}
    assert_rows_match([first], [sync_row], rel=1e-5, abs=1e-6)
    (pending,) = _pending_at_step_2(tmp_path)
    assert (pending["generation"], pending["version"]) == (2, 1) and pending["sampled_mask"].shape[0] == 8
    resumed_dir, engines, _ = _resumed_from_step_2(tmp_path, 4, max_staleness=1, **episodes)
    assert engines[0].generated_versions == [2, 3]  # generation 2 came from the checkpoint
    assert_rows_match(train_rows(resumed_dir), rows[2:], rel=0, abs=0)


def test_trl_environment_classes_run_ahead_with_their_reward_functions_scored_on_the_worker(tmp_path):
    """TRL's IncrementEnv with k = 1: the reward functions get the episodes' instances (`environments=`) on the
    engine's worker, where the episodes ran; the first generation (version 0) logs what the synchronous run logged;
    a checkpoint taken with episodes in flight keeps their scores, and the resumed run logs the same numbers; a
    reward function that raises there stops the run in one line when its generation is taken."""
    from lit_rl.errors import RewardFunctionError
    from tests.qwen_chat import save_qwen_chat_model

    trl = dict(
        model_name_or_path=str(save_qwen_chat_model(tmp_path / "qwen-chat")),
        environment="tests.integration.envs.IncrementEnv",
        reward_funcs=["tests.integration.envs.counter_untouched", "tests.integration.envs.trained_at_step"],
        max_turns=2,
    )
    sync_dir, _, _ = _fit(tmp_path / "sync", "run", 1, **trl)
    full_dir, engines, _ = _fit(tmp_path / "full", "run", 4, every_n=2, max_staleness=1, **trl)
    assert engines[0].generated_versions == [0, 0, 1, 2, 3]
    rows = train_rows(full_dir)
    # The random model calls no tool, so every counter is untouched: 1 from the instances themselves (None gives 0).
    assert [row["train/rewards/counter_untouched"] for row in rows] == [1.0] * 4
    # Scored on the worker ahead of time, but with the trainer state of the step that trains on them (g * m).
    assert [row["train/rewards/trained_at_step"] for row in rows] == [0.0, 1.0, 2.0, 3.0]
    (sync_row,) = train_rows(sync_dir)
    first = {key: value for key, value in rows[0].items() if not key.startswith(ASYNCHRONOUS_ONLY)}
    assert_rows_match([first], [sync_row], rel=1e-5, abs=1e-6)
    (pending,) = _pending_at_step_2(tmp_path)
    assert pending["generation"] == 2 and pending["reward_components"].shape == (8, 3)  # 2 functions, get_reward
    resumed_dir, _, _ = _resumed_from_step_2(tmp_path, 4, max_staleness=1, **trl)
    assert_rows_match(train_rows(resumed_dir), rows[2:], rel=0, abs=0)
    failing = {**trl, "reward_funcs": ["tests.integration.envs.fails_after_the_episode"]}
    with pytest.raises(RewardFunctionError) as failed:
        _fit(tmp_path / "failing", "run", 2, max_staleness=1, **failing)
    assert "fails_after_the_episode" in str(failed.value) and "no score for a counter at 0" in str(failed.value)
    assert "\n" not in str(failed.value)


def test_dynamic_sampling_refills_by_the_current_weights_and_resumes_to_the_same_numbers(tmp_path):
    """GRPO's dynamic sampling with k = 1: a generation sampled ahead is judged when it is taken; its refills are
    sampled then by the step's weights (a plain push, made before the next generation is launched, so the refills do
    not queue behind it), each row keeping its version; a resumed run logs the same numbers."""
    args = dict(max_staleness=1, dynamic_sampling=True, max_refill_generations=3, learning_rate=1e-3)
    versions = BufferVersions()
    full_dir, engines, digests = _fit(tmp_path / "full", "run", 4, every_n=2, callbacks=[versions], **args)
    (engine,) = engines
    for version, digest in engine.staged_digests.items():
        assert digest == digests.by_version[version], version
    assert engine.generated_versions == [0, 0, 1, 2, 3]  # generation g by version max(0, g - 1), as without refills
    rows = train_rows(full_dir)
    refill_steps = [int(row["step"]) - 1 for row in rows if row["train/refill_generations"] > 0]
    assert len(refill_steps) >= 2, rows
    # One push per step with refills, of that step's weights, when generations 0..s had been submitted (not s + 1).
    assert engine.sync_pushes == [(s + 1, digests.by_version[s]) for s in refill_steps]
    for row in rows:  # the generation's own rows carry its version max(0, s - 1), refill rows the step's own, s
        step = int(row["step"]) - 1
        generation_version, trained = max(0, step - 1), versions.by_step[step]
        if row["train/refill_generations"] > 0:
            assert set(trained) <= {generation_version, step}, (step, trained)
        else:
            assert trained == [generation_version] * 8, (step, trained)
        assert row["train/staleness/mean"] == pytest.approx(sum(step - v for v in trained) / 8), row
    assert any(step in versions.by_step[step] for step in refill_steps if step > 0)  # refill rows were trained on
    resumed_dir, engines, _ = _resumed_from_step_2(tmp_path, 4, **args)
    assert engines[0].generated_versions == [2, 3]  # generation 2 came from the checkpoint
    assert_rows_match(train_rows(resumed_dir), rows[2:], rel=0, abs=0)


def test_ppo_trains_with_asynchronous_rollouts_and_their_correction(tmp_path):
    """PPO, k = 1: the critic's values and the advantages are computed when a generation is taken (by the critic
    being trained); the policy term is weighed by the truncated engine ratio, and the fraction corrected logged."""
    from lit_rl.algorithms import PPO

    log_dir, engines, _ = _fit(tmp_path, "ppo", 3, algorithm=PPO, max_staleness=1)
    rows = train_rows(log_dir)
    assert [row["train/staleness/max"] for row in rows] == [0.0, 1.0, 1.0]
    assert engines[0].generated_versions == [0, 0, 1, 2]
    assert all(0.0 <= row["train/rollout_is_frac_corrected"] <= 1.0 for row in rows)
    assert all("train/critic/value_loss" in row for row in rows)
    model = PPO(**grouped_kwargs(PPO, max_staleness=1, vllm={"mode": "server"}))
    assert model.rollout_correction() == "token_truncate"


@pytest.mark.parametrize("k", [0, 1])
def test_episodes_that_cannot_start_stop_the_run_in_one_line_when_their_generation_is_taken(tmp_path, k, monkeypatch):
    """Sampled ahead (k = 1) or when taken (k = 0: on every rank together, before the turns' collectives). The
    failed run closes its engine on the way out (Lightning runs no `teardown` after an exception: a launched server
    and a generation in flight were left running, and the interpreter's exit waited for it)."""
    from lit_rl.errors import EnvironmentStepError
    from tests.integration.envs import BreaksWhenMade
    from tests.snapshot_engine import SnapshotEngine

    made, closed, init = [], [], SnapshotEngine.__init__
    monkeypatch.setattr(SnapshotEngine, "__init__", lambda engine, *args: made.append(engine) or init(engine, *args))
    monkeypatch.setattr(SnapshotEngine, "close", lambda engine: closed.append(engine) or engine.worker.shutdown())
    BreaksWhenMade.made = 0
    with pytest.raises(EnvironmentStepError) as failed:
        _fit(tmp_path, "broken", 2, environment="tests.integration.envs.BreaksWhenMade", max_staleness=k)
    assert str(failed.value) == ("model.env: the episodes could not start: RuntimeError: the sandbox pool is empty")
    assert closed == made and len(made) == k  # k = 0: the episodes failed before the engine was first used


@pytest.mark.parametrize("in_flight", [False, True])
def test_a_generation_whose_episodes_failed_before_a_checkpoint_is_sampled_again_by_the_resumed_run(
    tmp_path, capsys, in_flight
):
    """k = 1, 8 episodes a generation: generation 2 is launched at step 1 and its first reset fails (a dropped
    connection); the checkpoint at step 2 keeps the failure, and the run stops when it takes generation 2. Resumed
    from that checkpoint once the connection is back, the run samples generation 2 again, by the current weights,
    instead of stopping on the kept failure at every resume."""
    import itertools

    from lit_rl.errors import EnvironmentStepError
    from tests.integration.envs import DropsConnection

    args = dict(environment="tests.integration.envs.DropsConnection", max_staleness=1, in_flight_updates=in_flight)
    DropsConnection.resets, DropsConnection.failing = itertools.count(), frozenset({16})
    with pytest.raises(EnvironmentStepError, match="reset raised RuntimeError: the sandbox dropped the connection"):
        _fit(tmp_path / "full", "run", 4, every_n=2, **args)
    pending = _pending_at_step_2(tmp_path)
    assert [(entry["generation"], "failed" in entry) for entry in pending] == [(2, True)]
    capsys.readouterr()
    DropsConnection.resets, DropsConnection.failing = itertools.count(), frozenset()
    resumed_dir, _, _ = _resumed_from_step_2(tmp_path, 4, **args)
    said = [line for line in capsys.readouterr().err.splitlines() if "generation 2" in line]
    assert len(said) == 1 and said[0].startswith("lit-rl: generation 2's episodes failed before the checkpoint")
    assert said[0].endswith("the sandbox dropped the connection): sampling them again by the current weights")
    rows = train_rows(resumed_dir)
    assert [row["step"] for row in rows] == [3.0, 4.0]  # the optimizer steps after step 2
    assert [row["train/staleness/max"] for row in rows] == [0.0, 1.0]  # generation 2 by step 2's weights
    if in_flight:  # each model token tagged by the version that sampled it: the current one
        assert rows[0]["train/staleness/token_mean"] == 0.0


class BufferRows(Callback):
    """What each optimizer step trained on, by step (global_step before it): prompt and completion ids, each model
    token's version (-1 elsewhere) and each row's policy version, as lists."""

    def __init__(self):
        self.by_step: dict[int, dict[str, list]] = {}

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.step = trainer.global_step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        buffer = module._buffer
        self.by_step.setdefault(
            self.step,
            {
                "prompts": sorted(unpadded_prompts(buffer.prompt_ids, buffer.prompt_mask)),
                "completions": buffer.completion_ids.tolist(),
                "token_versions": buffer.token_versions.tolist(),
                "row_versions": buffer.policy_version.tolist(),
                "model_tokens": model_token_mask(buffer).tolist(),
            },
        )


def test_in_flight_updates_reach_a_running_episode_between_its_turns_and_resume_loses_no_prompt(tmp_path):
    """`model.rollout.in_flight_updates` with episodes, k = 1: generation 1's first episode answers its first turn
    only once generation 2 is launched beside it, with version 1 staged: its later turns are sampled by version 1,
    its first by 0, and the row is as stale as its oldest token. Every model token's version lies between its
    generation's v(g) and the step training on it, never decreasing along an episode; each version the engine loaded
    was the policy's at that step. A checkpoint taken with episodes in flight keeps their tokens' versions, and the
    resumed run trains the same generation from it and the same prompts after it: none lost, none twice."""
    from tests.integration.envs import AwaitsNewerWeights

    episodes = dict(
        environment="tests.integration.envs.AwaitsNewerWeights",
        environment_args={"wait_in": [1], "per_generation": 8},
        max_turns=3,
        max_new_tokens=3,
        max_staleness=1,
        in_flight_updates=True,
    )
    AwaitsNewerWeights.resets = 0
    trained = BufferRows()
    full_dir, engines, digests = _fit(tmp_path / "full", "run", 4, every_n=2, callbacks=[trained], **episodes)
    (engine,) = engines
    for version, digest in engine.staged_digests.items():
        assert digest == digests.by_version[version], version
    assert engine.loaded_versions == sorted(set(engine.loaded_versions)) and 1 in engine.loaded_versions
    for step, buffer in trained.by_step.items():
        launched = max(0, step - 1)  # v(g) of generation g = step
        rows = zip(buffer["token_versions"], buffer["model_tokens"], buffer["row_versions"])
        for versions, mask, row_version in rows:
            sampled = [v for v, m in zip(versions, mask) if m > 0]
            assert sampled == sorted(sampled) and launched <= sampled[0] and sampled[-1] <= step, (step, versions)
            assert row_version == sampled[0]
    mixed = [versions for versions in trained.by_step[1]["token_versions"] if {0, 1} <= set(versions)]
    assert len(mixed) >= 1, trained.by_step[1]["token_versions"]  # the waiting episode went on under version 1
    rows = train_rows(full_dir)
    assert [row["train/staleness/max"] for row in rows] == [0.0, 1.0, 1.0, 1.0]
    assert rows[1]["train/staleness/token_mean"] < rows[1]["train/staleness/mean"] == 1.0
    assert all(row["train/staleness/token_mean"] <= row["train/staleness/mean"] for row in rows)
    (pending,) = _pending_at_step_2(tmp_path)
    assert pending["generation"] == 2 and pending["token_versions"].shape == pending["completion_ids"].shape
    assert set(pending["token_versions"].unique().tolist()) <= {-1, 1}  # by v(2) = 1: no newer version before it
    resumed = BufferRows()
    AwaitsNewerWeights.resets = 16  # generations 3 and 4 (2 comes from the checkpoint): neither waits
    _resumed_from_step_2(tmp_path, 4, callbacks=[resumed], **episodes)
    assert resumed.by_step[2] == trained.by_step[2]  # generation 2, as the checkpoint kept it
    assert resumed.by_step[3]["prompts"] == trained.by_step[3]["prompts"]


def test_in_flight_updates_need_episodes_and_an_asynchronous_run():
    with pytest.raises(ConfigError, match=r"^model.rollout.in_flight_updates needs model.rollout.max_staleness > 0"):
        RolloutArgs(in_flight_updates=True).check()
    with pytest.raises(ConfigError, match=r"^model.rollout.in_flight_updates needs model.env: "):
        GRPO(**grouped_kwargs(GRPO, max_staleness=1, in_flight_updates=True, vllm={"mode": "server"}))
