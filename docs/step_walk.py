"""Write the walk of one GRPO step in `docs/architecture.md` from a traced step: which lit-rl files and functions one
optimizer step of `lit-rl fit --config configs/grpo.yaml` enters, in order, and which calls cross between two
files.

    python docs/step_walk.py            # rewrites the walk in docs/architecture.md
    python docs/step_walk.py --check    # exit 1 when the committed page differs (tests/test_docs_site.py)

It runs the config in this process for `TRACED_STEP + 1` optimizer steps (in a temporary folder: the run's
checkpoints and logs are thrown away) and traces step `TRACED_STEP` with `sys.setprofile`, as one period of the
loop: from the next batch's fetch after the step before has ended to the same point after the traced step, so the
loader, the module, the optimizer step and the callbacks' batch ends are each counted once. The first step is not
traced: it also builds what later steps reuse (the engine, the compiled policy, the metrics). Only calls into
`lit_rl/` count. A call's caller is the innermost lit-rl function on the stack, with torch or transformers in
between (a module's `forward` through `__call__`), or Lightning's loop when Lightning is in between (a hook);
a comprehension or lambda counts as the function it is written in.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

import lightning
from generated_page import write_or_check  # noqa: E402  (docs/ is the script's own folder)
from lightning.pytorch.callbacks import Callback

import lit_rl  # noqa: E402  (after lightning, as the CLI imports them)

REPO = Path(__file__).resolve().parents[1]
PACKAGE = os.path.dirname(lit_rl.__file__) + os.sep  # as the code objects name their files (the import path's form)
LIGHTNING = str(Path(lightning.__file__).parent) + os.sep
PAGE = REPO / "docs" / "architecture.md"
CONFIG = "configs/grpo.yaml"
TRACED_STEP = 2  # the second optimizer step: the first also builds what later steps reuse
BEGIN = "<!-- The walk below is written by `python docs/step_walk.py` from a traced step: do not edit it. -->"
END = "<!-- End of the generated walk. -->"

# (file, function, the calling lit-rl function's file and function; None: Lightning's loop called it)
Call = tuple[str, str, Optional[str], Optional[str]]


class StepTracer(Callback):
    """Records the calls into lit-rl of one period of the training loop (`calls`, in order): from the first call
    Lightning's loop makes into lit-rl after optimizer step `TRACED_STEP - 1` has ended, other than a batch-end
    callback (the next batch's fetch), to the same point after step `TRACED_STEP`."""

    traced: list["StepTracer"] = []  # the instances LightningCLI built, to read the calls back from

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.state = "waiting"  # -> armed -> tracing -> closing -> done
        StepTracer.traced.append(self)

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if self.state == "waiting" and trainer.global_step == TRACED_STEP - 1:
            self.state = "armed"
            sys.setprofile(self._profile)
        elif self.state == "tracing" and trainer.global_step == TRACED_STEP:
            self.state = "closing"

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event != "call" or self.state == "done" or not frame.f_code.co_filename.startswith(PACKAGE):
            return
        caller = frame.f_back  # the innermost lit-rl function below it, unless Lightning's loop calls it
        while caller is not None and not caller.f_code.co_filename.startswith(PACKAGE):
            if caller.f_code.co_filename.startswith(LIGHTNING):
                caller = None
                break
            caller = caller.f_back
        function = _function(frame.f_code)
        if caller is None and "on_train_batch_end" not in function:  # the loop goes on past the batch's end
            if self.state == "armed":
                self.state = "tracing"
            elif self.state == "closing":
                self.state = "done"
                return
        if self.state in ("tracing", "closing"):
            at = (_relative(caller.f_code.co_filename), _function(caller.f_code)) if caller else (None, None)
            self.calls.append((_relative(frame.f_code.co_filename), function, *at))


def _function(code: Any) -> str:
    """A code object's function: a comprehension, generator expression or lambda counts as the function it is in."""
    qualname = code.co_qualname  # Python 3.11+ (the walk's test runs on 3.11 and later)
    return qualname.split(".<locals>")[0] if qualname[0] != "<" else "<module>"


def _relative(filename: str) -> str:
    return "lit_rl/" + filename[len(PACKAGE) :].replace(os.sep, "/")


def traced_step() -> list[Call]:
    """The calls of one traced optimizer step of `CONFIG` (module docstring)."""
    from lit_rl.cli import main

    sys.modules.setdefault("step_walk", sys.modules[__name__])  # the CLI imports the callback by this name
    config = str(REPO / CONFIG)
    with tempfile.TemporaryDirectory() as folder:
        here = os.getcwd()
        os.chdir(folder)
        try:
            main(
                [
                    "fit",
                    "--config",
                    config,
                    "--trainer.max_steps",
                    str(TRACED_STEP + 1),  # the step after: its batch's fetch ends the traced period
                    "--trainer.enable_progress_bar",
                    "false",
                    "--trainer.callbacks+=step_walk.StepTracer",
                ]
            )
        finally:
            sys.setprofile(None)
            os.chdir(here)
    (tracer,) = StepTracer.traced
    assert tracer.state == "done", f"the run ended before step {TRACED_STEP} was traced"
    return tracer.calls


def render_walk(calls: list[Call]) -> str:
    """The walk's Markdown: the counts; the files in the order the step first enters them, each with its functions
    in the order first entered (those Lightning's loop calls marked); and for each pair of files, the distinct calls
    (a caller and a callee function) from one into the other, each way. Call counts are left out: how many decoding
    steps a batch takes depends on what was sampled, which float rounding on another CPU may change."""
    files: dict[str, dict[str, bool]] = {}  # file -> function -> called by Lightning
    edges: set[tuple[str, str, str, str]] = set()
    for file, function, caller_file, caller in calls:
        entered = files.setdefault(file, {})
        entered[function] = entered.get(function, False) or caller_file is None
        if caller_file is not None and caller_file != file:
            edges.add((caller_file, caller, file, function))
    pairs: dict[tuple[str, str], list[int]] = {}  # (a, b) sorted -> [calls a -> b, calls b -> a]
    for caller_file, _, file, _ in edges:
        first, second = sorted((caller_file, file))
        pairs.setdefault((first, second), [0, 0])[0 if caller_file == first else 1] += 1
    both_ways = sum(1 for forth, back in pairs.values() if forth and back)
    # A file none of whose functions calls into another lit-rl file returns to its caller: pure functions and value
    # types, read as their docstrings say. The others carry the step's control, and are where a reader follows it.
    callers = {caller_file for caller_file, _, _, _ in edges} | {
        file for file, entered in files.items() if any(entered.values())
    }
    leaves = [file for file in files if file not in callers]
    both_ways_subject = "pair's files call" if both_ways == 1 else "pairs call"
    functions = sum(len(entered) for entered in files.values())
    hooks = sum(called for entered in files.values() for called in entered.values())
    lines = [
        BEGIN,
        "",
        f"One optimizer step of `lit-rl fit --config {CONFIG}` (step {TRACED_STEP}, traced) enters **{len(files)} "
        f"lit-rl files** and **{functions} functions**, {hooks} of them called by Lightning's loop (its hooks, marked "
        f"\u21b3). Functions of one file call functions of another along **{len(edges)} distinct calls**, between "
        f"**{len(pairs)} pairs of files**; **{both_ways}** {both_ways_subject} each other both ways. "
        f"**{len(leaves)}** of the files call no other lit-rl file and no hook of theirs runs (marked \u25e6: each "
        f"returns to its caller); the other **{len(files) - len(leaves)}** carry the step's control.",
        "",
        "| # | file | functions, in the order the step first enters them |",
        "|---|---|---|",
    ]
    for number, (file, entered) in enumerate(files.items(), start=1):
        names = ", ".join(("\u21b3 " if called else "") + f"`{name}`" for name, called in entered.items())
        leaf = " \u25e6" if file in leaves else ""
        lines.append(f"| {number} | `{file}`{leaf} | {names} |")
    lines += [
        "",
        "The distinct calls between two files, each way (a caller function and a callee function; the most first):",
        "",
        "| file a | file b | a calls b | b calls a |",
        "|---|---|---|---|",
    ]
    for (first, second), (forth, back) in sorted(pairs.items(), key=lambda item: (-sum(item[1]), item[0])):
        lines.append(f"| `{first}` | `{second}` | {forth} | {back} |")
    return "\n".join([*lines, "", END])


def render() -> str:
    """docs/architecture.md with its walk rewritten from a traced step."""
    page = PAGE.read_text()
    if BEGIN not in page or END not in page:
        raise SystemExit(f"{PAGE} has no generated walk to rewrite (the lines {BEGIN!r} and {END!r})")
    before, rest = page.split(BEGIN, 1)
    after = rest.split(END, 1)[1]
    return before + render_walk(traced_step()) + after


if __name__ == "__main__":
    write_or_check(PAGE, render, "Write the walk of one GRPO step in docs/architecture.md from a traced step.")
