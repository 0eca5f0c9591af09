"""Loggers as a user switches to them, through the `lit-rl` script and the shipped config: Trackio (TRL's
`report_to="trackio"`) receives the same numbers as the CSV file, and a logger without versioned directories
still gets each run's config, checkpoints and export in a directory of its own."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lit_rl.resume import checkpoint_step
from tests.conftest import CONFIGS
from tests.integration.test_resume import SMALL, _env, _lit_rl

pytest.importorskip("trackio")

READ_BACK = """
import json
from trackio.sqlite_storage import SQLiteStorage
logs = [{k: v for k, v in row.items() if k != "timestamp"} for row in SQLiteStorage.get_logs("demo", "first-run")]
print(json.dumps([SQLiteStorage.get_runs("demo"), logs]))
"""
TWO_LOGGERS = """
trainer:
  logger:
    - class_path: lit_rl.loggers.TrackioLogger
      init_args: {project: demo, name: first-run}
    - class_path: lightning.pytorch.loggers.CSVLogger
      init_args: {save_dir: runs, name: csv}
"""


@pytest.mark.slow
def test_trackio_gets_every_logged_value_and_the_run_its_own_directory(tmp_path):
    (tmp_path / "loggers.yaml").write_text(TWO_LOGGERS)
    env = _env(tmp_path, TRACKIO_DIR=str(tmp_path / "trackio"))
    args = ["fit", "--config", str(CONFIGS / "grpo.yaml"), "--config", "loggers.yaml", *SMALL]
    result = _lit_rl(tmp_path, env, *args, "--trainer.max_steps", "4", "--trainer.val_check_interval", "2")
    assert result.returncode == 0, result.stderr[-3000:]

    # The first logger's run directory holds the run's files (not the shared `runs/`).
    run = tmp_path / "runs" / "demo" / "first-run"
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "config.yaml", "hf"]
    assert not (tmp_path / "runs" / "config.yaml").exists()
    assert (run / "checkpoints" / "last.ckpt").is_file() and (run / "hf" / "model.safetensors").is_file()

    # Read back through Trackio's own storage, in a process of its own: it reads TRACKIO_DIR when imported.
    read = subprocess.run(
        [sys.executable, "-c", READ_BACK], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    runs, logs = json.loads(read.stdout.strip().splitlines()[-1])
    assert runs == ["first-run"]
    tracked = [
        {k: v for k, v in row.items() if k.startswith(("train/", "val/"))} | {"step": row["step"]} for row in logs
    ]
    with open(tmp_path / "runs" / "csv" / "version_0" / "metrics.csv", newline="") as handle:
        written = [
            {k: float(v) for k, v in row.items() if v != "" and k.startswith(("train/", "val/"))}
            | {"step": int(row["step"])}
            for row in csv.DictReader(handle)
        ]
    key = lambda row: (row["step"], any(k.startswith("val/") for k in row))  # noqa: E731
    assert sorted(map(key, tracked)) == [(1, False), (2, False), (2, True), (3, False), (4, False), (4, True)]
    written = [row for row in written if len(row) > 1]  # rows with train/ or val/ values (perf/ ones aside)
    assert sorted(map(key, written)) == sorted(map(key, tracked))  # the CSV has the same rows, none more
    for got, expected in zip(sorted(tracked, key=key), sorted(written, key=key), strict=True):
        assert sorted(got) == sorted(expected)
        assert got == pytest.approx(expected, rel=1e-6), expected["step"]


@pytest.mark.slow
def test_a_trackio_folder_that_cannot_be_written_stops_the_run_before_it_starts_in_one_line(tmp_path):
    """Trackio only warns when it cannot write its database (`$TRACKIO_DIR`), at its first write, and the run's
    metrics are lost: refused before the first step, naming the folder."""
    (tmp_path / "a_file").write_text("")
    unusable = tmp_path / "a_file" / "trackio"
    env = _env(tmp_path, TRACKIO_DIR=str(unusable))
    args = ["fit", "--config", str(CONFIGS / "grpo.yaml"), "--trainer.logger", "lit_rl.loggers.TrackioLogger"]
    result = _lit_rl(tmp_path, env, *args, *SMALL, "--trainer.max_steps", "1")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"lit-rl: error: {unusable}: Not a directory: cannot write Trackio's database ($TRACKIO_DIR) there"
    )
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_a_new_run_never_writes_into_another_runs_directory(tmp_path):
    """Switched over a shipped config, `--trainer.logger lit_rl.loggers.TrackioLogger` takes the CSV logger's `name`
    (`grpo`) with it, so every such run had one directory: the second overwrote the first's config and export and
    wrote `last-v1.ckpt`. A new run into a directory that holds a run's files now stops in one line, and writes
    nothing; the command getting-started.md prints (with `--trainer.logger.name null`) gets a directory each time."""
    env = _env(tmp_path, TRACKIO_DIR=str(tmp_path / "trackio"))
    trackio = ("--trainer.logger", "lit_rl.loggers.TrackioLogger", "--trainer.logger.project", "my-project")
    args = ["fit", "--config", str(CONFIGS / "grpo.yaml"), *SMALL, "--trainer.max_steps", "1", *trackio]
    assert _lit_rl(tmp_path, env, *args).returncode == 0
    first = tmp_path / "runs" / "my-project" / "grpo"
    before = {path: path.read_bytes() for path in first.rglob("*") if path.is_file()}
    assert (first / "checkpoints" / "last.ckpt") in before and (first / "config.yaml") in before

    again = _lit_rl(tmp_path, env, *args)
    assert again.returncode == 1, again.stderr[-2000:]
    line = again.stderr.strip().splitlines()[-1]
    assert line.startswith(f"lit-rl: error: trainer.logger: the run directory {Path('runs/my-project/grpo')}")
    assert "give the run a directory of its own" in line and f"--ckpt_path {Path('runs/my-project/grpo')}" in line
    assert {path: path.read_bytes() for path in first.rglob("*") if path.is_file()} == before

    # `--ckpt_path last` continues that run (Lightning finds its last.ckpt): not refused.
    resumed = _lit_rl(tmp_path, env, *args, "--trainer.max_steps", "2", "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert _lit_rl(tmp_path, env, *args, "--trainer.logger.name", "null").returncode == 0
    runs = sorted(path.name for path in (tmp_path / "runs" / "my-project").iterdir())
    assert len(runs) == 2 and runs[0] == "grpo" and runs[1].startswith("my-project-")


@pytest.mark.slow
def test_a_run_with_a_version_fixed_by_hand_is_not_written_over_by_the_next(tmp_path):
    """A CSV `version` fixed by hand (`--trainer.logger.version my-exp`) names one directory for every run of the
    command: the next run deleted its `metrics.csv` and replaced its config, checkpoints and export. The next run
    now stops in one line and writes nothing; without a fixed version each run gets a new number. A run without a
    logger is refused where its directory (the working directory) holds a config.yaml, the user's own here."""
    env = _env(tmp_path)
    args = ["fit", "--config", str(CONFIGS / "grpo.yaml"), *SMALL, "--trainer.max_steps", "1"]
    assert _lit_rl(tmp_path, env, *args, "--trainer.logger.version", "my-exp").returncode == 0
    first = tmp_path / "runs" / "grpo" / "my-exp"
    before = {path: path.read_bytes() for path in first.rglob("*") if path.is_file()}
    assert {first / "metrics.csv", first / "config.yaml", first / "checkpoints" / "last.ckpt"} <= set(before)

    again = _lit_rl(tmp_path, env, *args, "--trainer.logger.version", "my-exp")
    assert again.returncode == 1, again.stderr[-2000:]
    line = again.stderr.strip().splitlines()[-1]
    assert line.startswith(f"lit-rl: error: trainer.logger: the run directory {Path('runs/grpo/my-exp')} holds")
    assert {path: path.read_bytes() for path in first.rglob("*") if path.is_file()} == before

    # Resumed from a checkpoint of another directory, the run would write into my-exp all the same: refused too.
    elsewhere = tmp_path / "elsewhere" / "step1.ckpt"
    elsewhere.parent.mkdir()
    shutil.copy(first / "checkpoints" / "last.ckpt", elsewhere)
    moved = _lit_rl(tmp_path, env, *args, "--trainer.logger.version", "my-exp", "--ckpt_path", str(elsewhere))
    assert moved.returncode == 1, moved.stderr[-2000:]
    line = moved.stderr.strip().splitlines()[-1]
    assert f"the run directory {Path('runs/grpo/my-exp')} holds" in line and f"resumed from {elsewhere}" in line
    assert {path: path.read_bytes() for path in first.rglob("*") if path.is_file()} == before
    # Its own checkpoint continues it.
    own = ("--trainer.logger.version", "my-exp", "--ckpt_path", str(first / "checkpoints" / "last.ckpt"))
    continued = _lit_rl(tmp_path, env, *args[:-1], "2", *own)
    assert continued.returncode == 0, continued.stderr[-2000:]
    assert checkpoint_step(first / "checkpoints" / "last.ckpt") == 2

    assert _lit_rl(tmp_path, env, *args).returncode == 0
    assert _lit_rl(tmp_path, env, *args).returncode == 0
    assert sorted(path.name for path in first.parent.iterdir()) == ["my-exp", "version_0", "version_1"]

    # Without a logger the run's directory is the working directory, where the user's own config.yaml is.
    (tmp_path / "config.yaml").write_text("# the user's own\n")
    unlogged = _lit_rl(tmp_path, env, *args, "--trainer.logger", "false")
    assert unlogged.returncode == 1, unlogged.stderr[-2000:]
    assert "--trainer.default_root_dir" in unlogged.stderr.strip().splitlines()[-1]
    assert (tmp_path / "config.yaml").read_text() == "# the user's own\n"
