"""Resume as a user meets it: the shipped config (its auto-versioned CSV logger, its checkpoint callback and HF
export), the `lit-rl` script, a Ctrl-C, and then the command lit-rl printed, typed as printed."""

from __future__ import annotations

import csv
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import CONFIGS, python_path

# Small settings on the command line; nothing here touches the logger, the checkpoints or the export.
SMALL = [
    "--model.sampling.num_generations", "4",
    "--model.schedule.micro_batch_size", "8",
    "--model.sampling.max_new_tokens", "4",
    "--data.val_limit", "16",
    "--data.val_batch_size", "16",
    "--trainer.val_check_interval", "4",
    "--trainer.enable_progress_bar", "false",
]  # fmt: skip

# A reward function that presses Ctrl-C on its own process (SIGINT) at its N-th call when SIGINT_AT_CALL=N: the
# stop lands at a known step, however fast the machine. It scores as the built-in correctness reward does.
STOPPER = """
import os, signal
from lit_rl.rewards.arithmetic import correctness as _correctness
calls = 0
def correctness(prompts, completions, **columns):
    global calls
    calls += 1
    if calls == int(os.environ.get("SIGINT_AT_CALL", "0")):
        os.kill(os.getpid(), signal.SIGINT)
    return _correctness(prompts, completions, **columns)
"""
REWARDS = ["--model.rewards.funcs", "[stopper.correctness, lit_rl.rewards.arithmetic.integer_format]"]

# Ctrl-C in a terminal: SIGINT to the whole foreground process group, every rank of a multi-process run at once.
# Sent by rank 0's reward function at its N-th call; the time it was sent goes to `signal_time`.
GROUP_STOPPER = """
import os, signal, time
from lit_rl.rewards.arithmetic import correctness as _correctness
calls = 0
def correctness(prompts, completions, **columns):
    global calls
    calls += 1
    if calls == int(os.environ.get("SIGINT_AT_CALL", "0")) and os.environ.get("LOCAL_RANK", "0") == "0":
        with open("signal_time", "w") as handle:
            handle.write(repr(time.time()))
        os.killpg(os.getpgid(0), signal.SIGINT)
    return _correctness(prompts, completions, **columns)
"""
# How long a pre-empted job has between SIGTERM and SIGKILL by default on Kubernetes (and a common Slurm setting).
GRACE_PERIOD_S = 30


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])  # this Python's lit-rl
    return {**os.environ, "PATH": path, "PYTHONPATH": python_path(tmp_path), **extra}


def _lit_rl(cwd: Path, env: dict[str, str], *args: str, **options: object) -> subprocess.CompletedProcess:
    return subprocess.run(["lit-rl", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600, **options)


def _rows(run: Path) -> list[dict[str, str]]:
    with open(run / "metrics.csv", newline="") as handle:
        return list(csv.DictReader(handle))


def _by_step(rows: list[dict[str, str]]) -> dict[tuple[int, str], dict[str, float]]:
    """Each metrics row keyed by (step, 'train' or 'val'); a row logged twice for one step fails."""
    out: dict[tuple[int, str], dict[str, float]] = {}
    for row in rows:
        values = {k: float(v) for k, v in row.items() if v != "" and not k.startswith(("perf/", "train/perf/"))}
        stage = "val" if any(k.startswith("val/") for k in values) else "train"
        key = (int(values["step"]), stage)
        assert key not in out, f"step {key} logged twice"
        out[key] = values
    return out


@pytest.mark.slow
def test_ctrl_c_then_the_printed_command_continues_the_same_run_exactly(tmp_path):
    (tmp_path / "stopper.py").write_text(STOPPER)
    reference, interrupted = tmp_path / "reference", tmp_path / "interrupted"
    reference.mkdir(), interrupted.mkdir()
    args = ["fit", "--config", str(CONFIGS / "grpo.yaml"), *SMALL, *REWARDS, "--trainer.max_steps", "10"]

    full = _lit_rl(reference, _env(tmp_path), *args)
    assert full.returncode == 0, full.stderr[-3000:]

    # Reward calls: steps 1-4, the validation at step 4, then step 5: Ctrl-C during step 5.
    stopped = _lit_rl(interrupted, _env(tmp_path, SIGINT_AT_CALL="6"), *args)
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    lines = [line for line in stopped.stderr.splitlines() if line.startswith("lit-rl: stopped by")]
    assert len(lines) == 1, stopped.stderr[-3000:]
    run = interrupted / "runs" / "grpo" / "version_0"
    assert f"after step 5; checkpoint written to {Path('runs/grpo/version_0/checkpoints/last.ckpt')};" in lines[0]
    printed = lines[0].split("resume with: ", 1)[1]
    assert shlex.split(printed) == ["lit-rl", *args, "--ckpt_path", "last"]
    # One `last` checkpoint, of the stopped step: no `last-v1.ckpt` beside it.
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["last.ckpt"]
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 5

    resumed = subprocess.run(
        printed, shell=True, cwd=interrupted, env=_env(tmp_path), capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"lit-rl: resuming from {Path('runs/grpo/version_0/checkpoints/last.ckpt')} (step 5)" in resumed.stderr
    assert sorted(p.name for p in (interrupted / "runs" / "grpo").iterdir()) == ["version_0"]  # the same run
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 10
    assert (run / "hf" / "model.safetensors").is_file()

    # The whole metrics file: every step once, train and validation, the same numbers as the run never stopped.
    expected = _by_step(_rows(reference / "runs" / "grpo" / "version_0"))
    got = _by_step(_rows(run))
    assert sorted(got) == sorted(expected)
    assert [step for step, stage in sorted(got) if stage == "train"] == list(range(1, 11))
    assert [step for step, stage in sorted(got) if stage == "val"] == [4, 8]
    for key, values in expected.items():
        assert sorted(got[key]) == sorted(values), key
        for name, value in values.items():
            assert got[key][name] == pytest.approx(value, rel=1e-5, abs=1e-6), (key, name)


@pytest.mark.slow
def test_ckpt_path_last_without_a_checkpoint_says_so_and_starts_at_step_0(tmp_path):
    result = _lit_rl(
        tmp_path,
        _env(tmp_path),
        *["fit", "--config", str(CONFIGS / "grpo.yaml"), *SMALL, "--trainer.max_steps", "1", "--ckpt_path", "last"],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"lit-rl: no checkpoint under {Path('runs/grpo')}: starting at step 0\n" in result.stderr
    assert "there is no last checkpoint available" not in result.stderr
    assert [row["step"] for row in _rows(tmp_path / "runs" / "grpo" / "version_0") if row.get("train/loss")] == ["1"]


@pytest.mark.slow
def test_ctrl_c_reaches_every_rank_of_a_two_process_run_and_the_printed_command_continues_it(tmp_path):
    """2 DDP processes with validation and the export on: Ctrl-C (SIGINT to the process group) stops both after the
    same step with one stop line, within a pre-emption's grace period and without exporting (the resumed run
    does); the printed command continues the run, and its metrics equal an uninterrupted 2-process run's."""
    (tmp_path / "stopper.py").write_text(GROUP_STOPPER)
    reference, interrupted = tmp_path / "reference", tmp_path / "interrupted"
    reference.mkdir(), interrupted.mkdir()
    ddp = ["--config", str(CONFIGS / "strategy" / "ddp.yaml"), "--model.schedule.micro_batch_size", "4"]
    args = ["fit", "--config", str(CONFIGS / "grpo.yaml"), *SMALL, *ddp, *REWARDS, "--trainer.max_steps", "8"]

    full = _lit_rl(reference, _env(tmp_path), *args)
    assert full.returncode == 0, full.stderr[-3000:]

    # A session of its own: the signal to the group reaches lit-rl's processes, not pytest.
    stopped = _lit_rl(interrupted, _env(tmp_path, SIGINT_AT_CALL="6"), *args, start_new_session=True)
    exited = time.time()
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    lines = [line for line in stopped.stderr.splitlines() if line.startswith("lit-rl: ")]
    assert len(lines) == 1 and lines[0].startswith("lit-rl: stopped by SIGINT after step 5; "), stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr
    stop_s = exited - float((interrupted / "signal_time").read_text())
    print(f"signal to exit: {stop_s:.1f} s")  # 2.1 s on 2 shared CPU cores
    assert stop_s < GRACE_PERIOD_S
    run = interrupted / "runs" / "grpo" / "version_0"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["last.ckpt"]
    assert not (run / "hf").exists()  # the export waits for the run's end

    printed = lines[0].split("resume with: ", 1)[1]
    resumed = subprocess.run(
        printed, shell=True, cwd=interrupted, env=_env(tmp_path), capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (run / "hf" / "model.safetensors").is_file()
    expected = _by_step(_rows(reference / "runs" / "grpo" / "version_0"))
    got = _by_step(_rows(run))
    assert sorted(got) == sorted(expected)
    assert [step for step, stage in sorted(got) if stage == "train"] == list(range(1, 9))
    assert [step for step, stage in sorted(got) if stage == "val"] == [4, 8]
    for key, values in expected.items():
        assert sorted(got[key]) == sorted(values), key  # the same metrics, none more, none fewer
        for name, value in values.items():
            assert got[key][name] == pytest.approx(value, rel=1e-5, abs=1e-6), (key, name)


@pytest.mark.slow
def test_a_shipped_config_run_leaves_the_checkpoints_and_summary_the_readme_shows(tmp_path):
    """The shipped GRPO config as it is (validation every 50 steps, a checkpoint every 100, `last` a link),
    for 150 steps: one periodic checkpoint at 100 and `last.ckpt` linking to it (a validation writes none of
    its own), validation rows at 50, 100 and 150, and a summary that names the checkpoint with its step (the run
    ended past it; its `hf/` export holds step 150)."""
    i = SMALL.index("--trainer.val_check_interval")
    small = SMALL[:i] + SMALL[i + 2 :]  # the shipped validation interval
    result = _lit_rl(tmp_path, _env(tmp_path), "fit", "--config", str(CONFIGS / "grpo.yaml"), *small,
                     "--trainer.max_steps", "150")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    checkpoints = tmp_path / "runs" / "grpo" / "version_0" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.ckpt", "step=100.ckpt"]
    assert (checkpoints / "last.ckpt").is_symlink() and os.readlink(checkpoints / "last.ckpt") == "step=100.ckpt"
    steps = _by_step(_rows(tmp_path / "runs" / "grpo" / "version_0"))
    assert [step for step, stage in sorted(steps) if stage == "val"] == [50, 100, 150]
    summary = result.stdout + result.stderr
    assert "lit-rl: done, 150 optimizer steps in " in summary
    assert f"  checkpoint {Path('runs/grpo/version_0/checkpoints/last.ckpt')} (step 100)" in summary
    assert f"  model      {Path('runs/grpo/version_0/hf')}" in summary
