"""The command line or the checkpoint, never silently, through the `lit-rl` script and the shipped config: a
resumed `fit` trains at the learning rate it is given and says so; a changed objective stops in one line and the
run's files stay as they were; `validate` scores with this run's reward functions in a run directory of its own;
a shared checkpoint's hyperparameters configure nothing."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import CONFIGS
from tests.integration.test_resume import SMALL, _env, _lit_rl, _rows

ARGS = ["--config", str(CONFIGS / "grpo.yaml"), *SMALL]
RUN = Path("runs") / "grpo" / "version_0"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A shipped-config run of 2 steps: its directory (cwd of the commands) and the environment to run them in."""
    cwd = tmp_path_factory.mktemp("trained")
    env = _env(cwd)
    result = _lit_rl(cwd, env, "fit", *ARGS, "--trainer.max_steps", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    return cwd, env


def _lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("lit-rl: ")]


def _refused_resume(trained, *changes: str) -> list[str]:
    """Resume the trained run to step 3 with `changes`: it must stop in one line, with no traceback, and leave the
    run's files as they were; its error lines. The run's metrics.csv gets a row of a step after the checkpoint's,
    as a run stopped between two checkpoints has: a resume would drop it (and log that step again), a refused one
    must not (it was cut, and config.yaml replaced with the refused values, before the refusal: Lightning loads
    the checkpoint after both are written)."""
    cwd, env = trained
    metrics = cwd / RUN / "metrics.csv"
    kept = metrics.read_text()
    lines = kept.splitlines(keepends=True)
    step = lines[0].strip().split(",").index("step")
    last = lines[-1].rstrip("\n").split(",")
    last[step] = "3"
    metrics.write_text(kept + ",".join(last) + "\n")
    before = {name: (cwd / RUN / name).read_text() for name in ("metrics.csv", "config.yaml")}
    try:
        result = _lit_rl(cwd, env, "fit", *ARGS, "--trainer.max_steps", "3", "--ckpt_path", "last", *changes)
        assert result.returncode == 1, result.stderr[-3000:]
        assert "Traceback" not in result.stderr
        assert {name: (cwd / RUN / name).read_text() for name in before} == before  # nothing written is lost
        assert torch.load(cwd / RUN / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 2
    finally:
        metrics.write_text(kept)
    return [line for line in result.stderr.splitlines() if "error" in line.lower()]


@pytest.mark.slow
def test_a_changed_objective_stops_in_one_line_and_keeps_the_run(trained):
    assert _refused_resume(trained, "--model.loss.beta", "0.1") == [
        f"lit-rl: error: --ckpt_path {RUN / 'checkpoints' / 'last.ckpt'} was trained with other values: "
        "model.loss.beta: 0.1 here, 0.0 in the checkpoint; a resumed run keeps what it was trained with "
        "(only the rates, token budgets and memory settings, validation sampling and model.rollout.engine may "
        "change): give the checkpoint's values, or start a new run without --ckpt_path"
    ]


@pytest.mark.slow
def test_another_accumulation_stops_in_one_line_and_keeps_the_run(trained):
    """The checkpoint's place is a count of micro-steps of its layout: with another accumulation the same count
    would be another place in the generations (before lit-rl refused it, this resume went on, exit 0, from
    micro-step 2 of a schedule whose generations are twice as large)."""
    assert _refused_resume(trained, "--trainer.accumulate_grad_batches", "2") == [
        f"lit-rl: error: --ckpt_path {RUN / 'checkpoints' / 'last.ckpt'} was trained with other values: "
        "trainer.accumulate_grad_batches: 2 here, 1 in the checkpoint; the checkpoint's place in the data counts "
        "micro-batches of its sizes on its ranks, in its data's order, and a resumed run continues from that place: "
        "give the checkpoint's values, or start a new run without --ckpt_path"
    ]


@pytest.mark.slow
def test_another_seed_stops_in_one_line_and_other_data_is_said(trained):
    """The prompts' order is a function of the data and `data.seed`: with another seed the checkpoint's place is a
    place in another order of the same prompts, and the resume repeated some and skipped others (before, exit 0 and
    not a word). Other data continues the run on it, said in one line."""
    (line,) = _refused_resume(trained, "--data.train_data", "builtin:addition/val", "--data.seed", "7")
    assert line.startswith(f"lit-rl: error: --ckpt_path {RUN / 'checkpoints' / 'last.ckpt'} was trained with other ")
    assert "data.seed: 7 here, 0 in the checkpoint; " in line and "data.train_data" not in line
    cwd, env = trained
    other = shutil.copytree(cwd / "runs", cwd.parent / "other_data_runs" / "runs")
    result = _lit_rl(other.parent, env, "fit", *ARGS, "--trainer.max_steps", "3", "--ckpt_path", "last", *OTHER_DATA)
    assert result.returncode == 0, result.stderr[-3000:]
    said = "lit-rl: data.train_data 'builtin:addition/val' from this run (the checkpoint has 'builtin:addition/train')"
    assert said in _lines(result.stderr)


OTHER_DATA = ["--data.train_data", "builtin:addition/val"]


@pytest.mark.slow
def test_validate_scores_with_this_runs_rewards_in_its_own_run_directory(trained):
    cwd, env = trained
    before = (cwd / RUN / "metrics.csv").read_text()
    rewards = [
        "--model.rewards.funcs",
        "[lit_rl.rewards.arithmetic.integer_format]",
        "--model.rewards.weights",
        "[1.0]",
    ]
    result = _lit_rl(cwd, env, "validate", *ARGS, "--ckpt_path", "last", *rewards)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "dirpath has changed" not in result.stderr  # Lightning's, about checkpoints this run does not write
    assert _lines(result.stderr) == [
        f"lit-rl: reading checkpoint {RUN / 'checkpoints' / 'last.ckpt'} (step 2)",
        "lit-rl: model.rewards.funcs ['lit_rl.rewards.arithmetic.integer_format'] from this run (the checkpoint has "
        "['lit_rl.rewards.arithmetic.correctness', 'lit_rl.rewards.arithmetic.integer_...)",
        "lit-rl: model.rewards.weights [1.0] from this run (the checkpoint has [1.0, 0.1])",
    ]
    (row,) = _rows(cwd / "runs" / "grpo" / "version_1")  # a new run directory: the trained run is untouched
    assert row["step"] == "2"  # the checkpoint's step (Lightning logged it at 0: checkpoints could not be told apart)
    assert set(k for k, v in row.items() if v and k.startswith("val/rewards/")) == {"val/rewards/integer_format"}
    assert (cwd / RUN / "metrics.csv").read_text() == before


@pytest.mark.slow
def test_validate_into_the_trained_runs_directory_is_refused_and_keeps_its_files(trained):
    """`--trainer.logger.version 0` points `validate` at the trained run: the CSV logger deleted its metrics file
    (every training row) and the run's config.yaml was replaced, exit 0 (an outside read found it)."""
    cwd, env = trained
    before = {name: (cwd / RUN / name).read_text() for name in ("metrics.csv", "config.yaml")}
    result = _lit_rl(cwd, env, "validate", *ARGS, "--ckpt_path", "last", "--trainer.logger.version", "0")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert _lines(result.stderr)[-1] == (
        f"lit-rl: error: trainer.logger: the run directory {RUN} holds another run's files (config.yaml, checkpoints, "
        "hf), which this validate would overwrite: give the run a directory of its own (the logger's name or version "
        "that names it, e.g. --trainer.logger.name; null makes a new one)"
    )
    assert {name: (cwd / RUN / name).read_text() for name in before} == before


@pytest.mark.slow
def test_a_shared_checkpoint_configures_nothing(trained, tmp_path):
    """A checkpoint whose hyperparameters name another class path, remote code and a reward module that writes a
    file when imported: the run stops naming the class, and nothing it names was imported."""
    cwd, env = trained
    (tmp_path / "evil.py").write_text(f"open({str(tmp_path / 'imported')!r}, 'w').close()\ndef reward(**kw): pass\n")
    checkpoint = torch.load(cwd / RUN / "checkpoints" / "last.ckpt", weights_only=True)
    checkpoint["hyper_parameters"].update(_class_path="evil.GRPO", trust_remote_code=True, reward_funcs=["evil.reward"])
    shared = tmp_path / "shared.ckpt"
    torch.save(checkpoint, shared)
    result = _lit_rl(tmp_path, _env(tmp_path), "fit", *ARGS, "--trainer.max_steps", "3", "--ckpt_path", str(shared))
    assert result.returncode == 1
    assert f"lit-rl: error: --ckpt_path {shared} was trained by evil.GRPO and this run's model is GRPO" in result.stderr
    assert not (tmp_path / "imported").exists()
    checkpoint["hyper_parameters"]["_class_path"] = "lit_rl.algorithms.GRPO"
    torch.save(checkpoint, shared)
    result = _lit_rl(tmp_path, _env(tmp_path), "fit", *ARGS, "--trainer.max_steps", "3", "--ckpt_path", str(shared))
    assert result.returncode == 1
    assert "model.policy.trust_remote_code: False here, True in the checkpoint" in result.stderr
    assert not (tmp_path / "imported").exists()


@pytest.mark.slow
def test_a_resumed_fit_trains_at_the_learning_rate_it_is_given(trained, tmp_path):
    cwd, env = trained
    copy = tmp_path / "copy"
    shutil.copytree(cwd / "runs", copy / "runs")
    result = _lit_rl(
        copy, env, "fit", *ARGS, "--trainer.max_steps", "3", "--ckpt_path", "last", "--model.optim.learning_rate", "0.5"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "lit-rl: model.optim.learning_rate 0.5 from this run (the checkpoint has 0.0001)" in _lines(result.stderr)
    saved = torch.load(copy / RUN / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 3
    assert [group["lr"] for group in saved["optimizer_states"][0]["param_groups"]] == [0.5]
    assert saved["lr_schedulers"][0]["base_lrs"] == [0.5]
