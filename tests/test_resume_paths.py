"""Which checkpoint and run directory a resume takes (`lit_rl.resume`), on directories laid out as the loggers lay
them out; the whole journey (Ctrl-C, the printed command) is in tests/integration/test_resume.py."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest
import torch
from jsonargparse import Namespace
from lightning.pytorch.loggers import CSVLogger

from lit_rl.errors import LitRLError
from lit_rl.resume import CheckpointError, ResumePoint, keep_run_metrics, resolve_ckpt_path, resumes_another_run


def _checkpoint(path: Path, step: int, mtime: float) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"global_step": step, "state_dict": {"w": torch.zeros(2)}}, path)
    os.utime(path, (mtime, mtime))
    return path


def _config(save_dir: Path, ckpt_path: str, version=None) -> Namespace:
    logger = Namespace(
        class_path="lightning.pytorch.loggers.CSVLogger",
        init_args=Namespace(save_dir=str(save_dir), name="grpo", version=version),
    )
    return Namespace(ckpt_path=ckpt_path, trainer=Namespace(logger=logger, callbacks=[]))


def test_last_is_the_newest_checkpoint_of_any_run_and_that_run_continues(tmp_path, capsys):
    runs = tmp_path / "runs" / "grpo"
    _checkpoint(runs / "version_0" / "checkpoints" / "last.ckpt", 7, 1000)
    _checkpoint(runs / "version_1" / "checkpoints" / "step=100.ckpt", 100, 3000)
    _checkpoint(runs / "version_1" / "checkpoints" / "last.ckpt", 120, 3000)
    _checkpoint(runs / "version_2" / "checkpoints" / "step=50.ckpt", 50, 2000)
    (runs / "version_3").mkdir()  # a run that died before its first checkpoint
    config = _config(tmp_path / "runs", "last")
    resumed = resolve_ckpt_path(config)
    assert resumed == ResumePoint(runs / "version_1" / "checkpoints" / "last.ckpt", 120, runs / "version_1")
    assert config.ckpt_path == str(runs / "version_1" / "checkpoints" / "last.ckpt")
    assert config.trainer.logger.init_args.version == 1
    assert capsys.readouterr().err == f"lit-rl: resuming from {resumed.checkpoint} (step 120) in {resumed.run}\n"


def test_an_explicit_checkpoint_of_a_run_continues_that_run(tmp_path):
    runs = tmp_path / "runs" / "grpo"
    checkpoint = _checkpoint(runs / "version_3" / "checkpoints" / "step=200.ckpt", 200, 1000)
    _checkpoint(runs / "version_4" / "checkpoints" / "last.ckpt", 300, 2000)
    config = _config(tmp_path / "runs", str(checkpoint))
    assert resolve_ckpt_path(config) == ResumePoint(checkpoint, 200, runs / "version_3")
    assert config.trainer.logger.init_args.version == 3
    elsewhere = _checkpoint(tmp_path / "elsewhere" / "model.ckpt", 9, 1000)  # not in a run: a new run directory
    config = _config(tmp_path / "runs", str(elsewhere))
    assert resolve_ckpt_path(config) == ResumePoint(elsewhere, 9, None)
    assert config.trainer.logger.init_args.version is None


def test_an_older_checkpoint_of_a_run_does_not_overwrite_its_later_ones(tmp_path):
    """Continuing a run from step 2 while it holds step 4 would overwrite step 4 and drop its metrics rows after
    step 2: refused in one line; a branch in a directory of its own (a version given by hand) goes ahead."""
    runs = tmp_path / "runs" / "grpo"
    older = _checkpoint(runs / "version_0" / "checkpoints" / "step=2.ckpt", 2, 1000)
    _checkpoint(runs / "version_0" / "checkpoints" / "step=4.ckpt", 4, 2000)
    with pytest.raises(LitRLError) as caught:
        resolve_ckpt_path(_config(tmp_path / "runs", str(older)))
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"--ckpt_path {older}: the run {runs / 'version_0'} has a later")
    assert "(step=4.ckpt, step 4)" in message and "--ckpt_path last" in message
    branch = _config(tmp_path / "runs", str(older), version="branch")
    assert resolve_ckpt_path(branch) == ResumePoint(older, 2, None)
    newest = runs / "version_0" / "checkpoints" / "step=4.ckpt"
    assert resolve_ckpt_path(_config(tmp_path / "runs", str(newest))) == ResumePoint(newest, 4, runs / "version_0")


def test_last_without_any_checkpoint_starts_at_step_0_and_says_so(tmp_path, capsys):
    config = _config(tmp_path / "runs", "last")
    assert resolve_ckpt_path(config) is None and config.ckpt_path is None
    assert capsys.readouterr().err == f"lit-rl: no checkpoint under {tmp_path / 'runs' / 'grpo'}: starting at step 0\n"


def test_a_damaged_checkpoint_is_one_line_naming_it_and_the_newest_intact_one(tmp_path):
    checkpoints = tmp_path / "runs" / "grpo" / "version_0" / "checkpoints"
    intact = _checkpoint(checkpoints / "step=100.ckpt", 100, 1000)
    damaged = _checkpoint(checkpoints / "last.ckpt", 150, 2000)
    damaged.write_bytes(damaged.read_bytes()[:200])  # truncated, as by a full disk
    with pytest.raises(CheckpointError) as caught:
        resolve_ckpt_path(_config(tmp_path / "runs", "last"))
    message = str(caught.value)
    assert message.startswith(f"checkpoint {damaged} cannot be read (") and "\n" not in message
    assert message.endswith(f"; the newest intact checkpoint beside it is {intact}")


def test_a_file_that_is_no_checkpoint_is_named_as_such_not_with_torchs_advice_to_save_it_again(tmp_path):
    """torch.load(mmap=True) of a file torch.save did not write says to save it `with _use_new_zipfile_serialization`:
    nothing a user given the wrong `--ckpt_path` can act on."""
    notes = tmp_path / "notes.txt"
    notes.write_text("step 200 was the good one\n")
    with pytest.raises(CheckpointError) as caught:
        resolve_ckpt_path(_config(tmp_path / "runs", str(notes)))
    assert str(caught.value) == (
        f"checkpoint {notes} cannot be read (not a checkpoint: not the zip archive torch.save writes; cut short, or "
        "another kind of file)"
    )


def test_the_resumed_run_keeps_its_metrics_rows_up_to_the_checkpoint_step(tmp_path):
    run = tmp_path / "runs" / "grpo" / "version_0"
    run.mkdir(parents=True)
    with open(run / "metrics.csv", "w", newline="") as handle:  # the stopped run logged up to step 8
        writer = csv.DictWriter(handle, fieldnames=["step", "train/loss", "val/reward"])
        writer.writeheader()
        writer.writerows({"step": step, "train/loss": step / 10, "val/reward": ""} for step in range(1, 9))
        writer.writerow({"step": 4, "train/loss": "", "val/reward": 0.5})
    logger = CSVLogger(tmp_path / "runs", name="grpo", version=0)
    keep_run_metrics([logger], ResumePoint(run / "checkpoints" / "step=5.ckpt", 5, run))
    logger.log_metrics({"train/loss": 0.6}, step=6)  # the resumed run goes on from step 6
    logger.save()
    with open(run / "metrics.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [(row["step"], row["train/loss"], row["val/reward"]) for row in rows] == [
        *((str(step), str(step / 10), "") for step in range(1, 6)),
        ("4", "", "0.5"),
        ("6", "0.6", ""),
    ]


def test_each_run_exports_into_its_own_directory_whatever_the_logger(tmp_path):
    import lightning as L
    from lightning.pytorch.loggers import Logger

    from lit_rl.callbacks.export import run_directory

    class RunIdLogger(Logger):  # as W&B: log_dir is the shared save_dir, the version is the run id
        def __init__(self, run_id: str) -> None:
            super().__init__()
            self.run_id = run_id

        name = property(lambda self: "project")
        version = property(lambda self: self.run_id)
        save_dir = property(lambda self: str(tmp_path / "wandb_runs"))

        def log_hyperparams(self, *args, **kwargs) -> None: ...

        def log_metrics(self, *args, **kwargs) -> None: ...

    def directory(logger):
        trainer = L.Trainer(logger=logger, accelerator="cpu", default_root_dir=tmp_path, enable_progress_bar=False)
        return run_directory(trainer)

    first, second = directory(RunIdLogger("abc123")), directory(RunIdLogger("def456"))
    assert first == tmp_path / "wandb_runs" / "project" / "abc123" and second.name == "def456"
    assert directory(CSVLogger(tmp_path / "runs", name="grpo", version=3)) == tmp_path / "runs" / "grpo" / "version_3"


def test_last_is_the_newest_checkpoint_even_beside_an_older_last_ckpt(tmp_path):
    """A graceful stop writes `last.ckpt` without `save_last` (step 150); the resumed run then saved steps 200 and
    300 and was killed: `last` is step 300, not the stale `last.ckpt` (which resumed at 150 before)."""
    run = tmp_path / "runs" / "grpo" / "version_0"
    _checkpoint(run / "checkpoints" / "last.ckpt", 150, 1000)
    _checkpoint(run / "checkpoints" / "step=200.ckpt", 200, 2000)
    newest = _checkpoint(run / "checkpoints" / "step=300.ckpt", 300, 3000)
    assert resolve_ckpt_path(_config(tmp_path / "runs", "last")) == ResumePoint(newest, 300, run)


def test_lightnings_own_names_and_urls_are_passed_on_unread(tmp_path):
    for name in ("best", "hpc", "s3://bucket/run/last.ckpt", "registry:my-model:latest"):
        config = _config(tmp_path / "runs", name)
        assert resolve_ckpt_path(config) is None and config.ckpt_path == name


def test_a_version_given_by_hand_is_kept_when_resuming_another_runs_checkpoint(tmp_path):
    """`--ckpt_path runs/grpo/version_0/... --trainer.logger.version my-exp` forks version_0 into my-exp: the
    version was replaced by 0 before, so the run wrote into version_0."""
    runs = tmp_path / "runs" / "grpo"
    checkpoint = _checkpoint(runs / "version_0" / "checkpoints" / "step=200.ckpt", 200, 1000)
    config = _config(tmp_path / "runs", str(checkpoint), version="my-exp")
    assert resolve_ckpt_path(config) == ResumePoint(checkpoint, 200, None)
    assert config.trainer.logger.init_args.version == "my-exp"
    own = _checkpoint(runs / "my-exp" / "checkpoints" / "last.ckpt", 250, 2000)  # its own: continued
    config = _config(tmp_path / "runs", str(own), version="my-exp")
    assert resolve_ckpt_path(config) == ResumePoint(own, 250, runs / "my-exp")


def test_last_with_a_logger_that_does_not_number_its_runs_is_lightnings_to_find(tmp_path):
    """W&B takes `save_dir`, `name` and `version` as the CSV logger does, but its runs are `<project>/<run id>`:
    searching `<save_dir>/<name>/version_*` for it resumed a CSV run's checkpoint into another directory."""
    _checkpoint(tmp_path / "runs" / "grpo" / "version_0" / "checkpoints" / "last.ckpt", 7, 1000)
    config = _config(tmp_path / "runs", "last")
    config.trainer.logger.class_path = "lightning.pytorch.loggers.WandbLogger"
    assert resolve_ckpt_path(config) is None and config.ckpt_path == "last"


def test_a_checkpoint_is_this_runs_only_in_its_checkpoint_directory(tmp_path):
    run = tmp_path / "runs" / "grpo" / "my-exp"
    own = _checkpoint(run / "checkpoints" / "last.ckpt", 2, 1000)
    other = _checkpoint(tmp_path / "runs" / "grpo" / "version_0" / "checkpoints" / "last.ckpt", 2, 1000)
    cluster = _checkpoint(tmp_path / "scratch" / "my-exp" / "step=2.ckpt", 2, 1000)
    assert not resumes_another_run(str(own), run, [])
    assert resumes_another_run(str(other), run, [])
    # Without a logger the run's directory is the working directory, which holds every other run: not enough.
    assert resumes_another_run(str(other), tmp_path, [])
    unlogged = _checkpoint(tmp_path / "checkpoints" / "last.ckpt", 2, 1000)
    assert not resumes_another_run(str(unlogged), tmp_path, [])
    # A checkpoint in an ancestor's `checkpoints/` is not this run's (it was taken for one, by a first version).
    assert resumes_another_run(str(unlogged), run, [])
    # A checkpoint callback's own `dirpath`; with TensorBoard's `sub_dir`, the run's directory is below the one
    # Lightning gives its checkpoints, which the CLI passes (`lightnings_checkpoint_dir`).
    assert resumes_another_run(str(cluster), run, []) and not resumes_another_run(str(cluster), run, [cluster.parent])
    assert resumes_another_run(str(own), run / "sub", [])
    assert not resumes_another_run(str(own), run / "sub", [str(run / "checkpoints")])
    assert not resumes_another_run("best", run, [])
    assert not resumes_another_run(str(tmp_path / "missing.ckpt"), run, [])  # Lightning's to report
