"""Resuming a run where it stopped: which checkpoint `--ckpt_path last` means, which run directory continues, and
the metrics file of that directory kept whole.

Lightning looks `last` up in the checkpoint directory of the *new* run; with an auto-versioned logger
(`runs/grpo/version_N`, the shipped configs) that is a fresh, empty `version_{N+1}`, so a resume silently started
again from step 0. lit-rl resolves `last` before the trainer exists instead:

1. the logger's run directories (`<save_dir>/<name>/version_*`, or the one its `version` names) are searched for
   checkpoints (`checkpoints/*.ckpt`, files or DeepSpeed directories);
2. the newest checkpoint (by modification time) wins (`last.ckpt` where it was written with the newest step file);
3. the logger's `version` is set to that run's, so the resumed run writes into the same directory;
4. an explicit `--ckpt_path runs/grpo/version_3/checkpoints/step=200.ckpt` continues `version_3` the same way,
   when it is that run's newest checkpoint: continuing from an older one would overwrite the later checkpoints and
   metrics rows, so it is refused in one line (a branch from it gets a directory of its own).

The CSV logger deletes `metrics.csv` when it opens an existing directory; `keep_csv_rows` puts back every row
up to the checkpoint's step (the rows a stopped run logged after its checkpoint are dropped: the resumed run logs
those steps again).
"""

from __future__ import annotations

import csv
import importlib
import re
import sys
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from lit_rl.errors import LitRLError, exception_line

CHECKPOINT_DIR = "checkpoints"
VERSION_DIR = re.compile(r"version_(\d+)$")


class CheckpointError(LitRLError):
    """A checkpoint that cannot be read (truncated, damaged, not a checkpoint)."""


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a run resumes from, the step it was written at, and the run directory that continues (None
    when the checkpoint is outside the logger's run directories: the run then gets a new one)."""

    checkpoint: Path
    step: int
    run: Optional[Path]


def resolve_ckpt_path(config: Any, continue_run: bool = True) -> Optional[ResumePoint]:
    """Resolve `config.ckpt_path` (a subcommand's parsed config) as the module docstring says, in place: `last`
    becomes the newest checkpoint's path (None, with one line saying so, where there is none), and, with
    `continue_run` (`fit`), the versioned logger's `version` becomes the resumed run's. `validate` (the CLI's
    other subcommand) reads the checkpoint and writes into a run directory of its own: opening the trained run's
    would replace its metrics file and config. Prints one line on rank 0 saying what is read."""
    requested = config.get("ckpt_path")
    if not requested or is_lightnings_to_resolve(str(requested)):
        return None
    found = versioned_logger(config.get("trainer.logger"))
    runs = run_directories(found) if found is not None else None
    if requested == "last":
        dirpath = explicit_checkpoint_dir(config.get("trainer.callbacks"))
        if dirpath is not None or runs is None:  # Lightning looks `last` up in that directory itself
            return None
        hit = newest_checkpoint(runs)
        if hit is None:
            say(f"no checkpoint under {runs.root}: starting at step 0")
            config.ckpt_path = None
            return None
        run, checkpoint = hit
        config.ckpt_path = str(checkpoint)
    else:
        checkpoint = Path(requested)
        run = run_of_checkpoint(checkpoint, runs) if runs is not None else None
        if run is not None and runs is not None and runs.version is not None and run != runs.versions()[0].resolve():
            run = None  # a version given by hand names the run's directory: the checkpoint's run is not continued
    step = checkpoint_step(checkpoint)
    if not continue_run:
        say(f"reading checkpoint {checkpoint} (step {step})")
        return ResumePoint(checkpoint, step, None)
    if run is not None:
        refuse_rewinding(run, checkpoint, step)
    if run is not None and found is not None and found.version is None:
        match = VERSION_DIR.match(run.name)
        found.version = int(match.group(1)) if match else run.name
    say(f"resuming from {checkpoint} (step {step})" + (f" in {run}" if run is not None else ""))
    return ResumePoint(checkpoint, step, run)


def refuse_rewinding(run: Path, checkpoint: Path, step: int) -> None:
    """Continuing `run` from `checkpoint` (written at `step`) while it holds a checkpoint of a later step would
    overwrite that checkpoint and drop the metrics rows after `step`: stopped in one line. Only checkpoints written
    after `checkpoint` are read (a later step is written later)."""
    written = checkpoint.stat().st_mtime
    for other in checkpoints_in(run):
        if other.stat().st_mtime <= written or other.resolve() == checkpoint.resolve():
            continue
        try:
            later = int(_read_state(other)["global_step"])
        except Exception:  # a damaged checkpoint holds nothing to lose
            continue
        if later > step:
            raise LitRLError(
                f"--ckpt_path {checkpoint}: the run {run} has a later checkpoint ({other.name}, step {later}), which "
                f"continuing the run from step {step} would overwrite, with its metrics after step {step}: continue "
                "the newest with --ckpt_path last, or branch from this one into a directory of its own "
                "(--trainer.logger.version NAME)"
            )


# `--ckpt_path` values Lightning resolves itself: its names, and remote paths (fsspec URLs).
LIGHTNING_CKPT_NAMES = ("best", "hpc")


def is_lightnings_to_resolve(ckpt_path: str) -> bool:
    """Whether `--ckpt_path` is one of Lightning's names (`best`, `hpc`, `registry...`) or a URL (`s3://...`):
    passed on unread (`last` is resolved here)."""
    return ckpt_path in LIGHTNING_CKPT_NAMES or ckpt_path.split(":")[0] == "registry" or "://" in ckpt_path


def explicit_checkpoint_dir(callbacks: Any) -> Optional[str]:
    """The `dirpath` a configured ModelCheckpoint writes to, when it names one."""
    for callback in callbacks or []:
        if str(getattr(callback, "class_path", "")).endswith("ModelCheckpoint"):
            dirpath = getattr(callback.init_args, "dirpath", None)
            if dirpath:
                return str(dirpath)
    return None


def keep_run_metrics(loggers: list[Any], resumed: ResumePoint) -> None:
    """Keep the rows up to the resumed step in the metrics file of every CSV logger that writes into the resumed
    run's directory (`keep_csv_rows`, `restore_csv_rows`); rank 0 only."""
    from lightning.pytorch.loggers import CSVLogger

    if not is_rank_zero() or resumed.run is None:
        return
    for logger in loggers:
        log_dir = getattr(logger, "log_dir", None)
        if isinstance(logger, CSVLogger) and log_dir and Path(log_dir).resolve() == resumed.run.resolve():
            header, rows = keep_csv_rows(Path(log_dir) / "metrics.csv", resumed.step)
            with warnings.catch_warnings():  # "... will be deleted": the rows are put back at once
                warnings.filterwarnings("ignore", message="Experiment logs directory .* exists and is not empty")
                restore_csv_rows(logger, header, rows)
    # Lightning's warning about a checkpoint directory with files in it: here that is the run being continued.
    warnings.filterwarnings("ignore", message="Checkpoint directory .* exists and is not empty")


# What a run writes into its directory besides the logger's own files: a directory holding one of them is a run's.
RUN_FILES = ("config.yaml", CHECKPOINT_DIR, "hf")


def refuse_another_runs_directory(
    run: Path, logged: bool = True, resuming: Optional[str] = None, subcommand: str = "fit"
) -> None:
    """A `fit` whose run directory `run` holds another run's files: a logger without versions (Trackio, or any whose
    version is a name) given a name an earlier run had, a CSV or TensorBoard logger whose `version` is fixed, or no
    logger (`logged` False: `default_root_dir`, the working directory by default, where a user's own `config.yaml`
    may be). Its config, checkpoints and export would be overwritten (the CSV logger deletes the metrics file too);
    stopped in one line. (Switching `--trainer.logger` over a shipped config carries the CSV logger's `name` into the
    new logger: every such run had the same name.) A numbered new run's directory is always new. A run resumed from
    a checkpoint (`resuming`, `--ckpt_path`) continues its directory where the checkpoint is inside it
    (`resumes_another_run` says when it is not). A `validate` (`subcommand`) never continues a run's directory."""
    found = [name for name in RUN_FILES if (run / name).exists()]
    if found:
        if resuming is not None:
            own = "e.g. --trainer.logger.version" if logged else "--trainer.default_root_dir"
            raise LitRLError(
                f"trainer.logger: the run directory {run} holds another run's files ({', '.join(found)}), which this "
                f"run, resumed from {resuming} (not a checkpoint of that run), would overwrite: give the run a "
                f"directory of its own ({own})"
            )
        last = run / CHECKPOINT_DIR / "last.ckpt"
        continued = f", or continue that run with --ckpt_path {last}" if last.exists() and subcommand == "fit" else ""
        own = (
            "the logger's name or version that names it, e.g. --trainer.logger.name; null makes a new one"
            if logged
            else "--trainer.default_root_dir, where a run without a logger writes"
        )
        raise LitRLError(
            f"trainer.logger: the run directory {run} holds another run's files ({', '.join(found)}), which this "
            f"{'new run' if subcommand == 'fit' else subcommand} would overwrite: give the run a directory of its own "
            f"({own}){continued}"
        )


def resumes_another_run(ckpt_path: str, run: Path, checkpoint_dirs: list[str]) -> bool:
    """Whether `--ckpt_path` names a checkpoint (file or DeepSpeed directory) of a run other than the one whose
    directory `run` this `fit` writes into. A checkpoint is this run's when it is in `<run>/checkpoints` or in a
    directory this run's checkpoints go to (`checkpoint_dirs`: a checkpoint callback's `dirpath`, the directory
    Lightning gives the logger's, `<save_dir>/<name>/<version>/checkpoints`, outside a TensorBoard `sub_dir`). Being
    anywhere below `run` is not enough: without a logger `run` is the working directory, which holds every other
    run. Lightning's names and URLs are Lightning's to resolve."""
    if is_lightnings_to_resolve(ckpt_path) or not Path(ckpt_path).exists():
        return False
    checkpoint = Path(ckpt_path).resolve()
    own = [run / CHECKPOINT_DIR, *map(Path, checkpoint_dirs)]
    return not any(directory.resolve() in checkpoint.parents for directory in own)


def is_rank_zero() -> bool:
    """Whether this process is global rank 0 (from the launcher's environment: the trainer is not set up yet)."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    return getattr(rank_zero_only, "rank", 0) == 0


def say(message: str) -> None:
    """One `lit-rl: ` line on stderr, from rank 0 only."""
    if is_rank_zero():
        sys.stderr.write(f"lit-rl: {message}\n")
        sys.stderr.flush()


@dataclass(frozen=True)
class RunDirectories:
    """Where a logger writes its runs: `<save_dir>/<name>/version_<version>` (`version` None: a new number)."""

    save_dir: Path
    name: str
    version: Optional[Any]

    @property
    def root(self) -> Path:
        return self.save_dir / self.name

    def versions(self) -> list[Path]:
        """The run directories to search: the one `version` names, or every `version_N`, oldest number first."""
        if self.version is not None:
            name = self.version if isinstance(self.version, str) else f"version_{self.version}"
            return [self.root / name]
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.root.iterdir() if (m := VERSION_DIR.match(p.name)) and p.is_dir()]
        return [path for _, path in sorted(found)]


def versioned_logger(logger_config: Any) -> Optional[Any]:
    """The init_args of the first configured logger that writes numbered run directories (CSV, TensorBoard, or a
    subclass: `<save_dir>/<name>/version_N`); None when there is none. W&B takes `save_dir`, `name` and `version`
    too, but its directories are `<project>/<run id>`: its `last` is Lightning's to find."""
    loggers = logger_config if isinstance(logger_config, list) else [logger_config]
    for logger in loggers:
        init_args = getattr(logger, "init_args", None) if logger is not None else None
        if init_args is not None and _numbers_its_runs(str(getattr(logger, "class_path", ""))):
            return init_args
    return None


def numbers_runs(logger_class: type) -> bool:
    """Whether loggers of `logger_class` lay runs out in numbered directories, `<save_dir>/<name>/version_N`: CSV,
    TensorBoard and their subclasses."""
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    return issubclass(logger_class, (CSVLogger, TensorBoardLogger))


def _numbers_its_runs(class_path: str) -> bool:
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return False
    return isinstance(cls, type) and numbers_runs(cls)


def run_directories(init_args: Any) -> RunDirectories:
    return RunDirectories(Path(init_args.save_dir or "."), str(init_args.name or ""), init_args.version)


def checkpoints_in(run: Path) -> list[Path]:
    """The checkpoints of one run directory, newest first (`last.ckpt` before a step file of the same time)."""
    directory = run / CHECKPOINT_DIR
    if not directory.is_dir():
        return []
    found = [p for p in directory.glob("*.ckpt") if not p.name.startswith(".") and p.exists()]
    return sorted(found, key=lambda p: (p.stat().st_mtime, p.name.startswith("last")), reverse=True)


def newest_checkpoint(runs: RunDirectories) -> Optional[tuple[Path, Path]]:
    """(run directory, checkpoint) of the newest checkpoint under `runs`, by modification time (`last.ckpt` where
    it was written with the newest step file, as `save_last` writes it); None when there is none. Not `last.ckpt`
    whatever its age: a graceful stop writes one without `save_last`, and the step files a resumed run writes after
    it are newer."""
    newest: Optional[tuple[float, Path, Path]] = None
    for run in runs.versions():
        found = checkpoints_in(run)
        if found and (newest is None or found[0].stat().st_mtime >= newest[0]):
            newest = (found[0].stat().st_mtime, run, found[0])
    return None if newest is None else (newest[1], newest[2])


def run_of_checkpoint(checkpoint: Path, runs: RunDirectories) -> Optional[Path]:
    """The run directory under `runs` that `checkpoint` belongs to (`<root>/version_N/checkpoints/x.ckpt`)."""
    parent = checkpoint.resolve().parent
    if parent.name != CHECKPOINT_DIR or parent.parent.parent != runs.root.resolve():
        return None
    return parent.parent if VERSION_DIR.match(parent.parent.name) or runs.version is not None else None


def checkpoint_step(path: Path) -> int:
    """The optimizer step a checkpoint was written at (its `global_step`), read without loading its tensors; a
    one-line `CheckpointError` naming the file (and the newest readable one beside it) when it cannot be read."""
    try:
        return int(_read_state(path)["global_step"])
    except Exception as err:
        others = (p for p in checkpoints_in(path.parent.parent) if p.resolve() != path.resolve())
        intact = next((p for p in others if _readable(p)), None)  # newest first: stop at the first readable one
        hint = f"; the newest intact checkpoint beside it is {intact}" if intact else ""
        raise CheckpointError(f"checkpoint {path} cannot be read ({_why(err)}){hint}") from err


def read_checkpoint(path: Path) -> dict[str, Any]:
    """A checkpoint's entries (file or DeepSpeed directory), its tensors memory-mapped, not read: what a resume
    compares before the run writes anything (`CheckpointState.refuse_resume_before_writing`)."""
    try:
        return _read_state(path)
    except Exception as err:
        raise CheckpointError(f"checkpoint {path} cannot be read ({_why(err)})") from err


def _read_state(path: Path) -> dict[str, Any]:
    if path.is_dir():  # DeepSpeed: a directory with one model-states file per model-parallel rank
        states = sorted(path.glob("**/*mp_rank_00_model_states.pt"))
        if not states:
            raise CheckpointError("no *mp_rank_00_model_states.pt inside")
        path = states[0]
    if not zipfile.is_zipfile(path):  # torch's own words would advise saving it again with a zipfile option
        raise CheckpointError(
            "not a checkpoint: not the zip archive torch.save writes; cut short, or another kind of file"
        )
    # mmap: only the metadata is read, not every tensor of a model of many GB.
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def _why(err: BaseException) -> str:
    """What kept a checkpoint from being read: lit-rl's own words as they are, a library's with its type."""
    return str(err) if isinstance(err, CheckpointError) else exception_line(err)


def _readable(path: Path) -> bool:
    try:
        _read_state(path)["global_step"]
    except Exception:
        return False
    return True


def keep_csv_rows(metrics_file: Path, up_to_step: int) -> tuple[list[str], list[dict[str, str]]]:
    """The header and the rows of a CSV logger's `metrics.csv` with `step <= up_to_step`: what a run resumed from
    a checkpoint of that step keeps (it logs every later step again)."""
    if not metrics_file.is_file():
        return [], []
    with metrics_file.open(newline="") as handle:
        reader = csv.DictReader(handle)
        rows = [row for row in reader if _step_of(row) is None or _step_of(row) <= up_to_step]
        return list(reader.fieldnames or []), rows


def _step_of(row: dict[str, str]) -> Optional[float]:
    try:
        return float(row.get("step") or "")
    except ValueError:
        return None


def restore_csv_rows(logger: Any, header: list[str], rows: list[dict[str, str]]) -> None:
    """Open `logger`'s writer (a `CSVLogger`: it deletes `metrics.csv` as it opens) and write `rows` back at once,
    so the resumed run appends after them."""
    writer = logger.experiment
    if not rows or not hasattr(writer, "metrics_keys"):
        return
    writer.metrics_keys = list(header)
    writer.metrics = [*rows, *writer.metrics]
    writer.save()
