"""DeepSpeed ZeRO-2 and ZeRO-3 on CPU processes (gloo), through the real CLI and the shipped overlays, with a
reference model (beta > 0) and gradient accumulation: the same per-step numbers as DDP, exact checkpoint cadence,
exact resume from sharded checkpoints, rollouts from a ZeRO-3 policy into vLLM, checkpoint conversion to a Hugging
Face directory, an 8-process run, checkpoint directories that survive a SIGKILL mid-save, and the non-finite guard
stopping (or skipping) a NaN step under ZeRO-2/3."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import (
    CLI_COMMAND,
    CONFIGS,
    FAST_GRPO,
    assert_rows_match,
    build_tiny_reward_model,
    cli_env,
    fit_in_subprocess,
    saved_steps,
    strategy_overlay,
    train_rows,
    without_engine_gap,
    write_overlay,
)
from tests.integration.probes import probe_flags

pytestmark = pytest.mark.slow

STRATEGY = CONFIGS / "strategy"


def _rows(log_dir):
    return without_engine_gap(train_rows(log_dir))


def _fit(tmp_path, name, strategy, *args, max_steps=4):
    return fit_in_subprocess(
        tmp_path,
        name,
        "grpo.yaml",
        *strategy_overlay(strategy),
        *FAST_GRPO,
        "--model.schedule.micro_batch_size",
        "4",
        "--trainer.accumulate_grad_batches",
        "2",
        "--model.loss.beta",
        "0.04",  # a frozen reference model too: partitioned under ZeRO-3, never given to the optimizer
        "--trainer.max_steps",
        str(max_steps),
        *args,
    )


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory):
    return _fit(tmp_path_factory.mktemp("ddp"), "ddp", "ddp")


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory):
    """The 4-step ZeRO-3 run, exporting the policy at its end: three tests read it (its rows against DDP's, its
    sharded step-2 checkpoint to resume from, its step-4 checkpoint to convert). The export runs in `on_train_end`,
    after the last row is logged and the last checkpoint saved: it changes neither."""
    export = ("--trainer.callbacks+", "lit_rl.callbacks.SaveHFPretrained")
    directory = tmp_path_factory.mktemp("zero3")
    return _fit(directory, "deepspeed_zero3", "deepspeed_zero3", *export, *_decoding_probe(directory))


def _decoding_probe(directory: Path) -> tuple[str, ...]:
    return probe_flags("RecordDecodingWeights", directory / "decoding_probe")


def _decoding(log_dir: Path) -> list[dict]:
    probe = log_dir.parents[2] / "decoding_probe"  # <tmp>/<name>/run/version_0 -> <tmp>/decoding_probe
    return [json.loads((probe / f"decoding_rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.parametrize("stage", ["deepspeed_zero2", "deepspeed_zero3"])
def test_zero_matches_ddp_step_for_step_with_exact_cadence(tmp_path, ddp_reference, stage, request):
    log_dir = request.getfixturevalue("zero3_run") if stage == "deepspeed_zero3" else _fit(tmp_path, stage, stage)
    assert saved_steps(log_dir) == [2, 4]  # every_n_train_steps=2 under accumulation 2: micro-batches 4 and 8
    assert (log_dir / "checkpoints" / "step=2.ckpt").is_dir()  # DeepSpeed writes sharded checkpoint directories
    rows = _rows(log_dir)
    assert [row["step"] for row in rows] == [1, 2, 3, 4]  # one row per optimizer step, not per micro-batch
    assert_rows_match(rows, _rows(ddp_reference), rel=1e-5, abs=1e-6)
    # grpo.yaml's gradient_clip_val 1.0 is DeepSpeed's clipping, said in one line instead of Lightning's warning
    # that the module's clipping hook "will not actually clip gradients".
    console = (log_dir.parents[2] / f"{log_dir.parents[1].name}.stderr").read_text()
    assert "will not actually clip" not in console
    zero = stage.removeprefix("deepspeed_zero")
    line = f"lit-rl: gradient clipping under DeepSpeed ZeRO-{zero}: its engine clips to a norm of 1 over every rank's"
    assert console.count(line) == 1, console[-3000:]


def test_zero3_decodes_from_whole_weights_without_its_hooks(zero3_run):
    """`HFGenerate(gather_weights=true)`, the default: each rank gathers the policy once per generation and decodes
    with DeepSpeed's per-module hooks hidden (they would gather and release every layer at every token); the same
    hooks are back for training, and the policy is partitioned again. Its rows match DDP's (above)."""
    for rank in _decoding(zero3_run):
        assert rank["forwards"] > 0 and rank["whole"], rank
        assert rank["hooks_while_decoding"] == 0 < rank["hooks_before"] == rank["hooks_after"], rank
        assert rank["generations"] > 0 and rank["released_after_each"], rank  # partitioned again: no copy kept


def test_zero3_decoding_through_its_partitions_matches_ddp(tmp_path, ddp_reference):
    """`gather_weights: false`, for a policy too large to hold whole: every decoding forward gathers layer by layer
    (the hooks stay), the ranks step together, and the run still matches DDP step for step."""
    engine = ("--model.rollout.engine", "HFGenerate", "--model.rollout.engine.gather_weights", "false")
    log_dir = _fit(tmp_path, "partitions", "deepspeed_zero3", *engine, *_decoding_probe(tmp_path))
    for rank in _decoding(log_dir):
        assert rank["forwards"] > 0 and not rank["whole"], rank
        assert rank["hooks_while_decoding"] > 0, rank
    assert_rows_match(_rows(log_dir), _rows(ddp_reference), rel=1e-5, abs=1e-6)


def test_zero3_trains_padding_free_with_token_budgets_and_head_chunks_like_ddp(tmp_path, ddp_reference):
    """Every ZeRO-3 forward is a collective: a packed forward is exactly one per call, a token budget that fits
    a step's 8 completions in one micro-batch leaves the other micro-step empty, a forward all the same, and the
    output head runs as many 4-token chunks on each rank (the most any rank needs; at least one when empty)."""
    budget = [
        "--model.policy.padding_free",
        "true",
        "--model.schedule.micro_batch_tokens",
        "120",
        "--model.policy.head_chunk_tokens",
        "4",
    ]
    log_dir = _fit(tmp_path, "zero3_budget", "deepspeed_zero3", *budget)
    assert saved_steps(log_dir) == [2, 4]
    rows = _rows(log_dir)
    # About 77 tokens for a step's 8 completions (measured): one micro-batch holds them all (fixed groups of 4
    # would hold about 38), so the step's other micro-step runs empty.
    assert all(60 < row.pop("train/micro_batch_tokens/max") <= 120 for row in rows)
    assert all(row.pop("train/rank_tokens/max") >= row.pop("train/rank_tokens/min") > 30 for row in rows)
    assert_rows_match(rows, _rows(ddp_reference), rel=1e-4, abs=1e-5)


def test_zero3_resumes_from_a_sharded_checkpoint_exactly(tmp_path, ddp_reference, zero3_run):
    # The step-2 checkpoint of the 4-step run: a fresh process resumes from it (with nothing of the first run but
    # its checkpoint directory) and must give that run's steps 3 and 4, which are DDP's.
    checkpoint = zero3_run / "checkpoints" / "step=2.ckpt"
    resumed = _fit(tmp_path, "resumed", "deepspeed_zero3", "--ckpt_path", str(checkpoint))
    assert saved_steps(resumed) == [4]  # its own directory: the next multiple of 2 after the resumed step
    rows = [row for row in _rows(resumed) if row["step"] > 2]
    assert [row["step"] for row in rows] == [3, 4]
    assert_rows_match(rows, _rows(ddp_reference), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("devices", [1, 2])
def test_zero3_policy_pushes_gathered_weights_into_vllm(tmp_path, devices):
    # In one process DeepSpeed's prefetch leaves parameters in flight when a training step starts; a push that
    # gathered them then failed with "Cannot partition a param in flight" (`settle_zero3_parameters`).
    colocate = ("--config", str(CONFIGS / "rollout" / "vllm_colocate.yaml"))
    log_dir = _fit(tmp_path, "vllm", "deepspeed_zero3", *colocate, "--trainer.devices", str(devices), max_steps=3)
    rows = train_rows(log_dir)
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        assert row["train/rollout_logprob_diff/max"] < 1e-4, row  # vLLM sampled from the whole, current policy


def test_zero3_checkpoint_converts_to_a_loadable_hf_directory(tmp_path, zero3_run):
    log_dir = zero3_run
    out = tmp_path / "hf-step4"
    subprocess.run(
        [sys.executable, "-m", "lit_rl.export", str(log_dir / "checkpoints" / "step=4.ckpt"), str(out)],
        env=cli_env(),
        check=True,
        capture_output=True,
        timeout=300,
    )
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    assert sum(p.numel() for p in model.parameters()) > 1_000_000
    # The converted step-4 checkpoint holds exactly the weights the run exported at its end (step 4).
    converted, exported = load_file(out / "model.safetensors"), load_file(log_dir / "hf" / "model.safetensors")
    assert sorted(converted) == sorted(exported)
    for key, value in exported.items():
        assert torch.equal(converted[key], value), key


@pytest.mark.eight_processes
def test_eight_zero3_processes_log_the_global_values_with_exact_cadence(tmp_path):
    # 8 ranks x 4 completions x accumulation 2 = 64 completions per step; one process with accumulation 16 takes
    # the same global batch, so its values are the global values the 8-process run must log. (DDP logs through the
    # same metric reduction, checked on 2 and 4 processes in test_rank_invariance.py; 8 ranks of ZeRO-3 also shard
    # every parameter 8 ways.)
    single = _rows(
        _fit(
            tmp_path, "single", "ddp", "--trainer.devices", "1", "--trainer.accumulate_grad_batches", "16", max_steps=2
        )
    )
    zero3_dir = _fit(tmp_path, "zero3_8", "deepspeed_zero3", "--trainer.devices", "8", max_steps=2)
    zero3 = _rows(zero3_dir)
    assert saved_steps(zero3_dir) == [2]
    assert [row["step"] for row in zero3] == [row["step"] for row in single] == [1, 2]
    assert_rows_match(zero3, single, rel=1e-5, abs=1e-6)


KILL_MID_SAVE = Path(__file__).with_name("kill_mid_save.py")
NONFINITE = Path(__file__).with_name("deepspeed_nonfinite.py")


def test_sigkill_in_the_middle_of_a_checkpoint_directory_save_leaves_the_previous_one_resumable(tmp_path):
    overlay = write_overlay(tmp_path / "o.yaml", every_n_train_steps=2, save_dir=tmp_path / "runs", save_last="link")
    args = ["fit", "--config", str(CONFIGS / "grpo.yaml"), "--config", str(overlay)]
    args += [*strategy_overlay("deepspeed_zero3"), *FAST_GRPO]
    # Every rank dies right after rank 0 wrote the first file of the step-4 checkpoint.
    killed = subprocess.Popen(
        [sys.executable, str(KILL_MID_SAVE), "step=4.ckpt", *args, "--trainer.max_steps", "6"],
        cwd=tmp_path,
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, stderr = killed.communicate(timeout=300)
    finally:
        if killed.poll() is None:
            os.killpg(killed.pid, signal.SIGKILL)
    assert killed.returncode == -signal.SIGKILL, stderr[-3000:]
    log_dir = tmp_path / "runs" / "run" / "version_0"
    checkpoints = log_dir / "checkpoints"
    assert saved_steps(log_dir) == [2] and not (checkpoints / "step=4.ckpt").exists()  # no half-written step 4
    partial = checkpoints / ".step=4.ckpt.tmp"
    assert any(p.is_file() for p in partial.rglob("*"))  # it was written, under the temporary name
    assert os.readlink(checkpoints / "last.ckpt") == "step=2.ckpt"
    resumed = subprocess.run(
        [*CLI_COMMAND, *args, "--trainer.max_steps", "4", "--ckpt_path", "last"],
        cwd=tmp_path,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # Continued from the step-2 checkpoint in the same run: its rows up to step 2 kept, each step once.
    assert [row["step"] for row in train_rows(log_dir)] == [1, 2, 3, 4]
    assert saved_steps(log_dir) == [2, 4] and not partial.exists()  # the next save removed the stale temporary
    for link in checkpoints.glob("last*.ckpt"):  # (the resumed run links `last-v1.ckpt`: Lightning's numbering)
        assert (checkpoints / os.readlink(link) / "latest").exists()  # each points at a complete checkpoint
    assert (checkpoints / "step=4.ckpt" / "latest").read_text() == "checkpoint"  # complete: DeepSpeed's last file


def _nonfinite_run(tmp_path, stage, action):
    """`deepspeed_nonfinite.py`: 2 ranks, 5 steps, the bias gradient NaN at step 3 on rank 1 only; both records."""
    result = subprocess.run(
        [sys.executable, str(NONFINITE), str(tmp_path), "--stage", str(stage), "--action", action, "--bad-step", "3"],
        cwd=tmp_path,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]  # failed once in CI (stage 3, skip) without a trace
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.parametrize("stage", [2, 3])
def test_nonfinite_guard_stops_before_a_nan_gradient_step_under_zero(tmp_path, stage):
    # The loss stays finite and only rank 1's bias gradient is NaN: under ZeRO-2/3 only the rank that owns that
    # partition sees it (`param.grad` is None everywhere), and every rank must stop.
    for record in _nonfinite_run(tmp_path, stage, "stop"):
        assert record["error"].startswith("NonFiniteError: non-finite loss or gradient at step 3"), record
        assert record["global_step"] == 2
        assert record["final"] == record["before_bad_step"]  # the bad step was not applied
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step=1.ckpt", "step=2.ckpt"]


@pytest.mark.parametrize("stage", [2, 3])
def test_nonfinite_guard_skips_a_nan_gradient_step_under_zero(tmp_path, stage):
    for record in _nonfinite_run(tmp_path, stage, "skip"):
        assert record["error"] is None and record["global_step"] == 5, record
        assert record["skipped_steps"] == 1 and record["logged_skipped_steps"] == 1.0, record
        assert record["after_bad_step"] == record["before_bad_step"], record  # skipped: weights unchanged
        assert record["final"] != record["before_bad_step"], record  # and training went on
        assert all(abs(w) < 1e6 for w in record["final"]), record  # finite (NaN fails every comparison)


def _fit_ppo(tmp_path, name, strategy, *args):
    return fit_in_subprocess(
        tmp_path,
        name,
        "ppo.yaml",
        *strategy_overlay(strategy),
        *FAST_GRPO,
        "--model.schedule.micro_batch_size",
        "4",
        "--trainer.accumulate_grad_batches",
        "2",
        "--model.loss.beta",
        "0.04",
        "--model.schedule.num_iterations",
        "2",
        "--model.optim.learning_rate",
        "1e-3",
        "--model.critic_learning_rate",
        "1e-2",
        "--trainer.max_steps",
        "4",
        *args,
    )


def test_ppo_under_zero3_matches_ddp_and_its_sharded_checkpoint_exports_the_critic(tmp_path):
    """The critic is built inside `deepspeed.zero.Init`, started from a reward model (its head read and written while
    gathered), trained as an optimizer group of its own, saved in the sharded checkpoint, and consolidated by
    `lit_rl.export` to the weights the run exported at its end."""
    critic = ("--model.critic_model_name_or_path", str(build_tiny_reward_model(tmp_path / "rm")))
    ddp = _fit_ppo(tmp_path, "ppo_ddp", "ddp", *critic)
    zero3 = _fit_ppo(
        tmp_path, "ppo_zero3", "deepspeed_zero3", *critic, "--trainer.callbacks+", "lit_rl.callbacks.SaveHFPretrained"
    )
    reference = _rows(ddp)
    assert [row["step"] for row in reference] == [1, 2, 3, 4]
    assert reference[0]["train/critic/values"] != 0  # the reward model's head, from the first step (else all 0)
    assert saved_steps(zero3) == [2, 4]
    rows = _rows(zero3)
    # Fractions of tokens clipped are counts: ZeRO-3 sums in another order, and a value within rounding of the clip
    # boundary may fall on its other side (one token of a step's ~56 is 0.018).
    for clipped in ("train/clip_ratio", "train/critic/value_clip_ratio"):
        for row, expected in zip(rows, reference, strict=True):
            assert abs(row.pop(clipped) - expected.pop(clipped)) < 0.02, clipped
    assert_rows_match(rows, reference, rel=1e-4, abs=1e-5)
    out = tmp_path / "exported"
    subprocess.run(
        [sys.executable, "-m", "lit_rl.export", str(zero3 / "checkpoints" / "step=4.ckpt"), str(out)],
        env=cli_env(),
        check=True,
        capture_output=True,
        timeout=300,
    )
    converted = load_file(out / "critic" / "model.safetensors")
    exported = load_file(zero3 / "hf" / "critic" / "model.safetensors")
    assert sorted(converted) == sorted(exported) and "score.weight" in exported
    for key, value in exported.items():
        assert torch.equal(converted[key], value), key


def test_episodes_that_end_at_different_turns_on_each_rank_train_under_zero3_like_ddp(tmp_path):
    """Under ZeRO-3 every `generate` step gathers the sharded weights from all ranks: a rank whose episodes ended
    (1-3 turns, by row) keeps joining the other rank's turns, or both would wait for ever."""
    environment = ("--model.env.environment", "tests.integration.envs.RowTurns", "--model.env.max_turns", "3")
    ddp = _fit(tmp_path, "env_ddp", "ddp", *environment, max_steps=2)
    zero3 = _fit(tmp_path, "env_zero3", "deepspeed_zero3", *environment, max_steps=2)
    reference = _rows(ddp)
    assert [row["step"] for row in reference] == [1, 2] and 1 < reference[0]["train/turns"] < 3
    assert_rows_match(_rows(zero3), reference, rel=1e-4, abs=1e-5)


def test_dpo_with_precomputed_reference_log_probs_and_sft_train_under_zero(tmp_path):
    """`configs/dpo_8gpu.yaml`'s combination on a CPU process: DPO under DeepSpeed bf16 with the reference's
    log-probs precomputed once. A loader of batches the data module builds (DPO's, SFT's) failed Lightning's
    batch-size probe; under ZeRO-3 the precompute copy was partitioned with nothing to gather it; and it computed in
    float32 beside a bf16 policy. At step 1 the policy is the reference: under ZeRO-2 loss ln 2 and margins 0
    exactly, as with a live reference; under ZeRO-3 the engine's own linear layers round the live forward's bf16
    differently (margins ~1e-4). The run's `hf/` export holds the optimizer's float32 master weights, as `lit-rl
    export` of its checkpoint does (it held the engine's bf16 copies). SFT trains under ZeRO-2."""

    def dpo_step_1(stage, *args, every_n_train_steps=None):
        log_dir = fit_in_subprocess(
            tmp_path,
            f"dpo_{stage}",
            "dpo.yaml",
            *strategy_overlay(f"deepspeed_{stage}"),
            *args,
            *("--trainer.devices", "1", "--trainer.precision", "bf16-mixed", "--trainer.max_steps", "1"),
            *("--data.batch_size", "8", "--data.val_data", "null", "--model.precompute_ref_logprobs", "true"),
            *("--model.ref_cache_dir", str(tmp_path / f"cache_{stage}")),
            every_n_train_steps=every_n_train_steps,
        )
        assert len(list((tmp_path / f"cache_{stage}").glob("ref_logprobs-*.pt"))) == 1
        first = train_rows(log_dir)[0]
        return log_dir, (first["train/loss"], first["train/rewards/margins"])

    ln2 = torch.tensor(math.log(2)).item()  # float32's, as logged
    export = ("--trainer.callbacks+", "lit_rl.callbacks.SaveHFPretrained")
    zero2, step_1 = dpo_step_1("zero2", *export, every_n_train_steps=1)
    assert step_1 == (ln2, 0.0)
    out = tmp_path / "exported"
    command = [sys.executable, "-m", "lit_rl.export", str(zero2 / "checkpoints" / "step=1.ckpt"), str(out)]
    subprocess.run(command, check=True, capture_output=True, env=cli_env(), timeout=300)
    hf, exported = load_file(zero2 / "hf" / "model.safetensors"), load_file(out / "model.safetensors")
    assert hf.keys() == exported.keys() and all(hf[k].dtype == torch.float32 for k in hf)
    assert all(torch.equal(hf[k], exported[k]) for k in hf)
    assert json.loads((zero2 / "hf" / "config.json").read_text())["dtype"] == "float32"  # not the engine's bf16
    _, (loss, margins) = dpo_step_1("zero3")
    assert abs(loss - ln2) < 1e-4 and abs(margins) < 1e-3, (loss, margins)
    sft = fit_in_subprocess(
        tmp_path,
        "sft",
        "sft.yaml",
        *strategy_overlay("deepspeed_zero2"),
        *("--trainer.devices", "1", "--trainer.max_steps", "2", "--trainer.log_every_n_steps", "1"),
        *(
            "--data.val_data",
            "null",
        ),
    )
    assert [row["step"] for row in train_rows(sft)] == [1, 2]


def test_an_offloaded_optimizer_state_steps_as_the_device_one(tmp_path):
    """`--trainer.strategy deepspeed_stage_2_offload` (a name Lightning registers): DeepSpeed refused lit-rl's torch
    AdamW beside an offloaded optimizer state with a multi-line traceback; AdamW now steps on the CPU partitions, to
    the same numbers as ZeRO-2 without offload."""
    rows = {}
    for strategy in ("deepspeed_stage_2", "deepspeed_stage_2_offload"):
        log_dir = fit_in_subprocess(
            tmp_path, strategy, "grpo.yaml", *FAST_GRPO, "--trainer.strategy", strategy, "--trainer.max_steps", "2"
        )
        rows[strategy] = _rows(log_dir)
    assert [row["step"] for row in rows["deepspeed_stage_2"]] == [1, 2]
    assert rows["deepspeed_stage_2_offload"] == rows["deepspeed_stage_2"]
