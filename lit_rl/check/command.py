"""`lit-rl check --config my.yaml [overrides]`: run a user's own config in pairs of layouts that must agree, and
print one table (pair, what was compared, the largest difference, the tolerance, PASS/FAIL/SKIP); exit 1 on any
FAIL.

The pairs and their layouts are in `lit_rl.check.layouts`, the comparison and tolerances in
`lit_rl.check.compare`. Every run goes through `lit-rl fit` with the user's model, data, rewards and options; only
the keys a pair is about change, plus what keeps the runs apart from the user's own (their logger and checkpoints
go to a scratch directory; no HF export, and no validation but in the validation pair).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import yaml

from lit_rl.check.compare import PairResult, judge, tolerance_for
from lit_rl.check.layouts import (
    CannotRunHere,
    Layout,
    accumulation_layout,
    check_runs_here,
    get,
    packing_layout,
    processes,
    ranks_layouts,
    run_config,
    strategy_in_ranks_pair,
    validation_layout,
)
from lit_rl.check.mismatch import KL_ROUNDING, MISMATCH_METRICS, moved_most, run_mismatch, steps_needed
from lit_rl.check.runner import RunFailed, RunResult, fit, last_line, read_run, resume
from lit_rl.errors import OneLineArgumentParser

PAIRS = ("accumulation", "packing", "ranks", "validation", "resume", "cadence")
EXIT_FAIL = 1
EXIT_NOTHING_CHECKED = 2
EXIT_INTERRUPTED = 130  # stopped by Ctrl-C (128 + SIGINT, as `lit-rl fit`)
HELP = """Run your config in pairs of layouts that must train to the same numbers, and say whether they do.

  lit-rl check --config my.yaml [fit overrides] [--quick] [--steps K] [--pairs accumulation,resume]

Pairs: accumulation (your micro-batches against one per step), ranks (1 process against 2), packing (padded
against padding-free), validation (a validation batch after every micro-step against none), resume (K steps
against a stop after about K/2 and the printed resume command), cadence (checkpoints every 2 steps, straight and
resumed). Exit 1 when a pair fails, 2 when none could run here or
your config itself is refused (`lit-rl fit` would refuse it too), 130 when stopped by Ctrl-C (the pairs finished
so far are shown; the one running is neither PASS nor FAIL).

  lit-rl check --config my.yaml --mismatch

One step as configured and one per factor changed (engine, dtype, packing, lora): which factor moves the
engine-trainer log-prob mismatch (train/rollout_kl) most.
"""


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = OneLineArgumentParser(prog="lit-rl check", description=HELP, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 steps per run (the resume pair stops after step 1)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (even, >= 2; default 4)")
    parser.add_argument("--pairs", default=",".join(PAIRS), help=f"a comma-separated subset of {','.join(PAIRS)}")
    parser.add_argument("--workdir", default=None, help="keep the runs here (default: a temporary directory)")
    parser.add_argument(
        "--mismatch", action="store_true", help="instead: which factor moves the engine-trainer log-prob mismatch"
    )
    options, fit_args = parser.parse_known_args(argv)
    steps = options.steps if options.steps is not None else (2 if options.quick else 4)
    if steps < 2 or steps % 2:
        parser.error(f"--steps must be even and at least 2, got {steps}")
    options.steps = steps
    options.pairs = [p.strip() for p in options.pairs.split(",") if p.strip()]
    unknown = [p for p in options.pairs if p not in PAIRS]
    if unknown:
        parser.error(f"--pairs: unknown {unknown}; choose from {list(PAIRS)}")
    if "--config" not in fit_args and not any(a.startswith("--config=") for a in fit_args):
        parser.error("give the config to check: lit-rl check --config my.yaml")
    return options, fit_args


def resolved_config(fit_args: list[str]) -> dict:
    """The config `lit-rl fit *fit_args` would run, every default filled in (`--print_config`)."""
    from lit_rl.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(["fit", *fit_args, "--print_config"])
        except SystemExit as stop:
            if stop.code not in (0, None):
                lines = [line for line in err.getvalue().splitlines() if line.strip()]
                line = lines[-1] if lines else f"lit-rl fit exited with {stop.code}"
                raise CannotRunHere(line.removeprefix("lit-rl: error: ")) from None
    return yaml.safe_load(out.getvalue())


CONFIG_ERROR = "lit-rl: error: "  # how `lit-rl fit` refuses its input: the last line of its output


class ConfigRefused(Exception):
    """The user's config as configured is refused by `lit-rl fit` itself (a value it checks only as it builds the
    model or the data, which `--print_config` in `resolved_config` does not): every pair would fail alike, so no
    pair did. The message is `fit`'s, without its `lit-rl: error: `."""


def trained_a_step(directory: Path) -> bool:
    """Whether the run in `directory` logged a training step or wrote a checkpoint: its error then came while it
    trained (`NonFiniteGuard`, a reward function's, a checkpoint's write), not from refusing its config."""
    runs = list((directory / "run").glob("version_*"))
    logged = any((run / "metrics.csv").is_file() and (run / "metrics.csv").stat().st_size > 0 for run in runs)
    return logged or any(any(run.glob("checkpoints/*")) for run in runs)


def as_configured(layout: Layout) -> bool:
    """A layout that runs the user's config as it is (`straight`; `--mismatch`'s `as_configured`)."""
    return not layout.changes and layout.stop_at is None


class Check:
    """The runs of one check, each run once and shared by the pairs that need it."""

    def __init__(self, config: dict, workdir: Path, steps: int, say: Callable[[str], None]) -> None:
        self.config, self.workdir, self.steps, self.say = config, workdir, steps, say
        # Checkpoints every 2 steps, and the resume pair stops between two of them (step K/2, or K/2 + 1 where
        # K/2 is even): a resumed run that counted its cadence from the stop would then miss a step.
        self.every_n = 2
        self.stop_at = steps // 2 if (steps // 2) % 2 else steps // 2 + 1
        self.results: dict[str, RunResult] = {}
        self.configured_ran = False  # a run as configured has finished (`straight`, or `--mismatch`'s baseline)

    def run(self, layout: Layout) -> RunResult:
        if layout.name in self.results:
            return self.results[layout.name]
        directory = self.workdir / layout.name
        config = run_config(self.config, layout, str(directory), self.steps, self.every_n, str(directory))
        count = processes(config)
        started = time.monotonic()
        self.say(f"  run {layout.name} ({layout.describe()}, {count} process{'es' * (count > 1)})")
        code = fit(config, directory, count)
        try:
            if layout.stop_at is not None:
                result = read_run(directory, directory)
                if code != 143 or result.resume_command is None or result.stopped_at != layout.stop_at:
                    raise RunFailed(
                        f"{layout.name} did not stop at step {layout.stop_at} (exit {code}, stopped after step "
                        f"{result.stopped_at}): {last_line(directory)}"
                    )
                self.say(f"  resume {layout.name} with the printed command: {result.resume_command}")
                code = resume(directory, result.resume_command, count)
            if code != 0:
                raise RunFailed(
                    f"{layout.name} failed (exit {code}): {last_line(directory)} (log: {directory}/output.log)"
                )
            result = read_run(directory, directory)
        except RunFailed:
            self.refuse_a_config_error(layout, directory)
            raise
        self.say(f"    {time.monotonic() - started:.0f} s")
        self.results[layout.name] = result
        self.configured_ran |= as_configured(layout)
        return result

    def refuse_a_config_error(self, layout: Layout, directory: Path) -> None:
        """`ConfigRefused` where the run in `directory` ended on `lit-rl fit`'s own refusal (`lit-rl: error: ...`)
        and the config as configured is refused too: the user's value, which every pair would otherwise report as
        its own failure (exit 1). A change of the layout's that `fit` refuses (padding-free for a model that cannot
        pack) fails only its pair: the run as configured, which most pairs compare with anyway, tells them apart."""
        line = last_line(directory)
        if not line.startswith(CONFIG_ERROR) or trained_a_step(directory):
            return  # a run that failed while training (a diverged loss, a full disk) is its pair's FAIL, runs kept
        if as_configured(layout):
            raise ConfigRefused(line.removeprefix(CONFIG_ERROR))
        if not self.configured_ran:
            with contextlib.suppress(RunFailed):  # a failure of another kind is reported by a pair that needs it
                self.straight()

    def straight(self) -> RunResult:
        return self.run(Layout("straight"))

    def last_step(self, layout: Layout) -> dict[str, float]:
        """The `train/` values of the last step of `layout` (the runs of `--mismatch`)."""
        result = self.run(layout)
        return next((row for row in result.rows if int(row["step"]) == self.steps), {})


def policy_dtype(config: dict) -> Optional[str]:
    """`model.policy.dtype`, with `auto` resolved as the loader resolves it: the checkpoint's own dtype (float32
    for a randomly initialised model or a config that names none)."""
    policy = get(config, "model.init_args.policy") or {}
    dtype = policy.get("dtype")
    if dtype != "auto":
        return dtype
    if get(config, "model.init_args.random_init"):  # SFT from a config alone
        return "float32"
    from lit_rl.modeling.models import checkpoint_dtype

    return checkpoint_dtype(policy["model_name_or_path"], bool(policy.get("trust_remote_code"))) or "float32"


# The pairs of one changed layout against the user's run as configured: how the layout is made, and how the
# reference reads in the table.
AGAINST_THE_STRAIGHT_RUN = {
    "accumulation": (accumulation_layout, "as configured"),
    "packing": (packing_layout, "as configured"),
    "validation": (validation_layout, "none"),
}


def check_pair(check: Check, pair: str, gpus: int) -> PairResult:
    on_cpu = gpus == 0 or get(check.config, "trainer.accelerator") == "cpu"
    tol = tolerance_for(get(check.config, "trainer.precision"), policy_dtype(check.config), on_cpu)
    if pair in AGAINST_THE_STRAIGHT_RUN:
        make_layout, reference = AGAINST_THE_STRAIGHT_RUN[pair]
        layout = make_layout(check.config)
        result = judge(pair, check.run(layout), check.straight(), tol)
        result.compared = f"{layout.describe()} vs {reference}, {result.compared}"
        return result
    if pair == "ranks":
        one, two = ranks_layouts(check.config, gpus)
        reference = check.straight() if one.name == "straight" else check.run(one)
        result = judge(pair, check.run(two), reference, tol)
        where = "GPUs" if gpus >= 2 else "CPU, gloo"
        result.compared = f"2 processes vs 1 ({where}; {strategy_in_ranks_pair(check.config)}), {result.compared}"
        return result
    stop = check.stop_at
    if pair == "resume":
        resumed = check.run(Layout("resumed", stop_at=stop))
        # Every step, those before the stop too: the resumed run's metrics file must keep what the stopped run wrote.
        result = judge(pair, resumed, check.straight(), tol)
        result.compared = f"stopped at {stop} and resumed vs straight, {result.compared}"
        return result
    if pair == "cadence":
        expected = list(range(check.every_n, check.steps + 1, check.every_n))
        straight, resumed = (
            check.straight().checkpoint_steps,
            check.run(Layout("resumed", stop_at=stop)).checkpoint_steps,
        )
        ok = straight == expected and resumed == expected
        detail = "" if ok else f"straight {straight}, resumed {resumed}"
        return PairResult(
            pair, f"checkpoints at {expected}, straight and resumed", "PASS" if ok else "FAIL", detail=detail
        )
    raise ValueError(pair)


def rendered(table) -> str:
    """A rich table as plain text, 130 columns wide, whatever the terminal."""
    from rich.console import Console

    buffer = io.StringIO()
    Console(file=buffer, width=130, force_terminal=False).print(table)
    return buffer.getvalue()


def print_table(results: list[PairResult], write: Callable[[str], None]) -> None:
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="lit-rl check", show_lines=False)
    for column in ("pair", "compared", "largest difference", "tolerance", "result"):
        table.add_column(column)
    for r in results:
        style = {"PASS": "green", "FAIL": "bold red", "SKIP": "yellow"}[r.status]
        cells = [escape(text) for text in (r.pair, r.compared, r.largest(), r.tolerance.name if r.tolerance else "")]
        table.add_row(*cells, f"[{style}]{r.status}[/{style}]")
    tolerances = sorted({r.tolerance for r in results if r.tolerance}, key=str)
    notes = [
        "Compared: every train/ metric at the steps shown, and the final weights as ||a - b|| / ||b - start||.",
        "Not compared: perf/ (timings), train/rollout_* (engine-trainer rounding, different in every layout),",
        "train/micro_batch_tokens/max and train/rank_tokens/* (token budgets: they describe the layout).",
        *(
            f"Tolerance {t.name}: |a - b| <= {t.atol:g} + {t.rtol:g} |b| per metric; weights <= {t.parameters:g}."
            for t in tolerances
        ),
    ]
    write(rendered(table) + "\n".join(notes) + "\n")


# The runs of a pair must not differ by the BLAS's own choices: unless told otherwise, MKL picks its code path by
# the data's memory alignment and (MKL_DYNAMIC) its thread count by the machine's load, which moves float rounding
# from run to run. Set before the first matrix product of the process, and inherited by the runs it starts.
REPRODUCIBLE_BLAS = {"MKL_CBWR": "AUTO,STRICT", "MKL_DYNAMIC": "FALSE"}


def main(argv: Optional[list[str]] = None) -> None:
    try:
        _check(argv)
    except KeyboardInterrupt:  # the pairs print what they finished first (`_check`)
        sys.stderr.write("lit-rl check: stopped by Ctrl-C\n")
        sys.exit(EXIT_INTERRUPTED)


def _check(argv: Optional[list[str]]) -> None:
    for name, value in REPRODUCIBLE_BLAS.items():
        os.environ.setdefault(name, value)
    options, fit_args = parse(sys.argv[2:] if argv is None else argv)

    def say(line: str) -> None:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()

    try:
        config = resolved_config(fit_args)
    except CannotRunHere as err:
        say(f"lit-rl check: error: {err}")
        sys.exit(EXIT_NOTHING_CHECKED)
    import torch

    gpus = torch.cuda.device_count()
    scratch = options.workdir is None
    workdir = Path(options.workdir or tempfile.mkdtemp(prefix="lit-rl-check-"))
    if options.mismatch:
        keep = False
        try:
            mismatch(Check(config, workdir, steps_needed(config), say), gpus, say)
        except ConfigRefused as err:
            say(f"lit-rl check: error: {err}")
            sys.exit(EXIT_NOTHING_CHECKED)
        except RunFailed as err:  # a run crashed or wrote nothing: keep the runs, and say where they are
            keep = True
            say(f"lit-rl check: error: {err}")
            say(f"lit-rl check: the runs are in {workdir}")
            sys.exit(EXIT_NOTHING_CHECKED)
        finally:
            if scratch and not keep:
                shutil.rmtree(workdir, ignore_errors=True)
        return
    check = Check(config, workdir, options.steps, say)
    results: list[PairResult] = []
    try:
        check_runs_here(config, gpus)
    except CannotRunHere as err:
        results = [PairResult(pair, "", "SKIP", detail=f"cannot run here: {err}") for pair in options.pairs]
    interrupted = False
    try:
        for pair in options.pairs if not results else ():
            say(f"lit-rl check: {pair}")
            try:
                results.append(check_pair(check, pair, gpus))
            except ConfigRefused:  # every pair would fail on it: none is a result
                raise
            except CannotRunHere as err:
                results.append(PairResult(pair, "", "SKIP", detail=f"cannot run here: {err}"))
            except RunFailed as err:
                results.append(PairResult(pair, "", "FAIL", detail=str(err)))
            except Exception as err:  # noqa: BLE001  (one pair's error must not lose the others' results)
                results.append(PairResult(pair, "", "FAIL", detail=f"{type(err).__name__}: {err}"))
    except KeyboardInterrupt:  # the pair that was running is not a result: neither a PASS nor a FAIL
        interrupted = True
    except ConfigRefused as err:  # the user's value, as `lit-rl fit` would say it; the runs hold nothing else
        if scratch:
            shutil.rmtree(workdir, ignore_errors=True)
        say(f"lit-rl check: error: {err}")
        sys.exit(EXIT_NOTHING_CHECKED)
    if results:
        print_table(results, sys.stdout.write)
    failed = [r.pair for r in results if r.status == "FAIL"]
    passed = [r.pair for r in results if r.status == "PASS"]
    if scratch and not failed:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        say(f"lit-rl check: the runs are in {workdir}")
    if interrupted:
        unchecked = [pair for pair in options.pairs if pair not in {r.pair for r in results}]
        say(f"lit-rl check: stopped by Ctrl-C; not checked: {', '.join(unchecked)}")
        sys.exit(EXIT_INTERRUPTED)
    if failed:
        say(f"lit-rl check: FAIL: {', '.join(failed)}")
        sys.exit(EXIT_FAIL)
    if not passed:
        say("lit-rl check: no pair could be checked here (see SKIP above)")
        sys.exit(EXIT_NOTHING_CHECKED)
    say(f"lit-rl check: PASS: {', '.join(passed)}")


def mismatch(check: Check, gpus: int, say: Callable[[str], None]) -> None:
    """`--mismatch`: one step as configured and one per factor changed; a table of their mismatch metrics. A run
    that fails raises `RunFailed` (the caller keeps the runs and says where)."""
    from rich.table import Table

    try:
        check_runs_here(check.config, gpus)
        baseline, results = run_mismatch(check.config, check.last_step)
    except CannotRunHere as err:
        say(f"lit-rl check: error: {err}")
        sys.exit(EXIT_NOTHING_CHECKED)
    table = Table(title=f"lit-rl check --mismatch: step {check.steps}, engine against trainer")
    for column in ("factor", "changed", "rollout_kl", "is_ratio min / max", "logprob diff max"):
        table.add_column(column)

    def cells(values: dict[str, float]) -> list[str]:
        got = [values.get(key) for key in MISMATCH_METRICS]
        if got[0] is None:
            return ["not logged", "", ""]
        return [f"{got[0]:.3g}", f"{got[1]:.6g} / {got[2]:.6g}", f"{got[3]:.3g}"]

    table.add_row("as configured", "", *cells(baseline))
    for r in results:
        table.add_row(r.factor, r.change or r.skipped, *([""] * 3 if r.skipped else cells(r.values)))
    sys.stdout.write(rendered(table))
    most = moved_most(baseline, results)
    if most is not None:
        sys.stdout.write(f"The factor that moves rollout_kl most: {most}.\n")
    elif "train/rollout_kl" in baseline:
        sys.stdout.write(f"No factor moves rollout_kl beyond rounding (at or below {KL_ROUNDING:g}).\n")
