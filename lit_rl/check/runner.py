"""Running one layout of `lit-rl check` through the real `lit-rl fit`, and reading back what it wrote.

One-process layouts run in this process (as the test suite runs the CLI); multi-process layouts as a `lit-rl fit`
process, since Lightning starts the other ranks by running the same command again. Each run's output goes to
`output.log` in its directory, so a failed run can be read afterwards.
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
import yaml

from lit_rl.check.probe import INITIAL_PARAMETERS_FILE, PARAMETERS_FILE, REDUCTIONS_FILE
from lit_rl.resume import checkpoint_step

RESUME_HINT = "resume with: "
# `lit-rl fit`'s exit code after a Ctrl-C (`GracefulStop`: the step finished, `last.ckpt` written). The check's own
# stop of the resume pair sends SIGTERM (143): 130 is always the user's.
EXIT_AFTER_CTRL_C = 128 + signal.SIGINT
STOPPED_AFTER = re.compile(r"stopped by \w+ after step (\d+)")  # lit_rl.cli.exit_if_interrupted's line


class RunFailed(Exception):
    """A layout's run ended with an error; the message is its last line of output and where the rest is."""


@dataclass
class RunResult:
    rows: list[dict[str, float]]  # each `train/` row of metrics.csv, with its step
    parameters: dict[str, torch.Tensor]  # the module's floating-point state after the last step
    initial_parameters: Optional[dict[str, torch.Tensor]]  # ... before the first, where the run started at step 0
    checkpoint_steps: list[int] = field(default_factory=list)  # global_step of every checkpoint but `last`
    resume_command: Optional[str] = None  # what a stopped run printed
    reductions: dict[str, str] = field(default_factory=dict)  # logged name -> how it is reduced
    stopped_at: Optional[int] = None  # the step a stopped run said it stopped after


def fit(config: dict, directory: Path, processes: int = 1) -> int:
    """`lit-rl fit --config <directory>/config.yaml`; its exit code. Output goes to `output.log`."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return run_cli(directory, ["fit", "--config", str(path)], processes)


def run_cli(directory: Path, args: list[str], processes: int = 1) -> int:
    """`lit-rl *args`, its output appended to `<directory>/output.log`; its exit code. In this process, or in a
    process of its own where the run has several (Lightning starts the other ranks by running the command again).

    A Ctrl-C that stopped the run raises `KeyboardInterrupt`: the user stopped the check, and the run's exit must
    not read as a pair that failed."""
    with open(directory / "output.log", "a") as log:
        if processes > 1:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # this process's imports
            env["PYTHONSAFEPATH"] = "1"  # `-m` would put the working directory first (Python 3.11+ honours this)
            run = subprocess.Popen([sys.executable, "-m", "lit_rl.cli", *args], stdout=log, stderr=log, env=env)
            code = _wait_or_stop(run)
        else:
            code = _run_in_this_process(args, log)
    if code == EXIT_AFTER_CTRL_C:
        raise KeyboardInterrupt
    return code


STOP_GRACE_S = 120.0  # seconds a stopped multi-process run has to end after its Ctrl-C


def _wait_or_stop(run: subprocess.Popen) -> int:
    """The exit code of a multi-process run. On a Ctrl-C (KeyboardInterrupt here) the run is ended before the
    check: a SIGINT to its rank 0 (after the one a terminal sends every process of the job, a second Ctrl-C:
    `lit-rl fit` then stops at once and ends its other ranks; alone, all ranks stop after the current step), and
    SIGKILL to rank 0 if it has not ended after `STOP_GRACE_S`."""
    try:
        return run.wait()
    except KeyboardInterrupt:
        run.send_signal(signal.SIGINT)
        try:
            run.wait(timeout=STOP_GRACE_S)
        except BaseException:  # not ended in time, or another Ctrl-C: end it now
            run.kill()
            run.wait()
        raise


def _run_in_this_process(args: list[str], log: Any) -> int:
    from lit_rl.cli import main

    handler = signal.getsignal(signal.SIGINT)
    with (
        contextlib.redirect_stdout(log),
        contextlib.redirect_stderr(log),
        lightning_info_quiet(),
        command_line(["lit-rl", *args]),
        signals_received() as received,
    ):
        try:
            main(args)
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 1
        except Exception as err:  # noqa: BLE001  (reported as the run's failure, with its log)
            log.write(f"{type(err).__name__}: {err}\n")
            code = 1
        finally:
            if handler is not None:  # Lightning ignores SIGINT while it shuts down after a KeyboardInterrupt
                signal.signal(signal.SIGINT, handler)
    # A Ctrl-C that Lightning turned into its exit 1 (a KeyboardInterrupt inside `fit`: a second Ctrl-C, or one
    # before lit-rl's graceful stop took SIGINT over) is the user's too, not a failed run.
    if signal.SIGINT in received:
        raise KeyboardInterrupt
    return code


@contextlib.contextmanager
def signals_received():
    """The numbers of the signals that reached this process while the block ran, whichever Python handler took them
    (Python writes each to the wake-up fd). Empty outside the main thread, where no wake-up fd can be set."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return
    read, write = os.pipe()
    os.set_blocking(read, False)
    os.set_blocking(write, False)
    previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    try:
        yield received
    finally:
        signal.set_wakeup_fd(previous)
        try:
            received.extend(os.read(read, 4096))
        except BlockingIOError:  # nothing written
            pass
        os.close(read)
        os.close(write)


@contextlib.contextmanager
def lightning_info_quiet():
    """Lightning's info lines ("Seed set to 0", "GPU available") go through `logging` handlers that hold the
    terminal's stream, past the redirection into the run's log: hold them back while a run goes."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


@contextlib.contextmanager
def command_line(argv: list[str]):
    """`sys.argv` as if the user had typed the run's command: LightningCLI warns when it is given arguments while
    `sys.argv` holds others (`lit-rl check ...`)."""
    saved = sys.argv
    sys.argv = argv
    try:
        yield
    finally:
        sys.argv = saved


def last_line(directory: Path) -> str:
    lines = [line for line in (directory / "output.log").read_text().splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("lit-rl: error:") or "Error" in line.split(":", 1)[0]]
    return (errors or lines or ["no output"])[-1].strip()


def read_run(directory: Path, save_dir: Path) -> RunResult:
    """What a finished (or stopped) run left: its train rows, final parameters, checkpoints and resume hint."""
    runs = sorted((save_dir / "run").glob("version_*"))
    if not runs:
        raise RunFailed(f"no run directory under {save_dir}: {last_line(directory)}")
    run = runs[-1]
    if not (run / "metrics.csv").exists() or not (directory / PARAMETERS_FILE).exists():
        raise RunFailed(f"{directory.name} wrote no metrics or no weights: {last_line(directory)}")
    rows = []
    with open(run / "metrics.csv", newline="") as handle:
        for row in csv.DictReader(handle):
            values = {k: float(v) for k, v in row.items() if v != "" and (k.startswith("train/") or k == "step")}
            if any(k.startswith("train/") for k in values):
                rows.append(values)
    probe = torch.load(directory / PARAMETERS_FILE, weights_only=True)
    initial_file = directory / INITIAL_PARAMETERS_FILE
    initial = torch.load(initial_file, weights_only=True)["parameters"] if initial_file.exists() else None
    steps = []
    for checkpoint in sorted((run / "checkpoints").glob("*.ckpt")):  # files, or DeepSpeed's directories
        if checkpoint.is_symlink() or checkpoint.name.startswith("last"):
            continue
        steps.append(checkpoint_step(checkpoint))
    hints = [line for line in (directory / "output.log").read_text().splitlines() if RESUME_HINT in line]
    hint = hints[-1].split(RESUME_HINT, 1)[1].strip() if hints else None
    stopped = STOPPED_AFTER.search(hints[-1]) if hints else None
    reductions_file = directory / REDUCTIONS_FILE
    reduced = json.loads(reductions_file.read_text()) if reductions_file.exists() else {}
    stopped_at = int(stopped.group(1)) if stopped else None
    return RunResult(rows, probe["parameters"], initial, sorted(steps), hint, reduced, stopped_at)


def resume(directory: Path, command: str, processes: int = 1) -> int:
    """Run the command a stopped run printed, as a user would type it."""
    args = shlex.split(command)
    if args[:1] != ["lit-rl"]:
        raise RunFailed(f"the stopped run printed an unexpected resume command: {command}")
    return run_cli(directory, args[1:], processes)
