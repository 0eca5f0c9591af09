"""A process that ran collectives ends without the interpreter's finalization (`exit_without_finalizing`), where
torch 2.13's process-group threads can abort a finished run: what still runs (atexit handlers, flushed streams, the
exit code), what no longer does (finalization), and `console_main` taking that exit only inside a process group."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Writes at interpreter finalization (module teardown), and only then: the mark that finalization ran. It writes to
# the file descriptor itself, bound beforehand: `sys.stdout` may be gone by then.
FINALIZATION_MARK = """
import os
class Finalized:
    def __del__(self, write=os.write):
        write(1, b"finalized")

mark = Finalized()
"""


def run_python(code: str, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", "import sys\n" + FINALIZATION_MARK + code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_exit_without_finalizing_joins_threads_runs_the_atexit_handlers_flushes_and_exits_with_the_code(tmp_path):
    result = run_python(
        """
import atexit, threading, time
from lit_rl.strategies import exit_without_finalizing
atexit.register(lambda: open("atexit.txt", "w").write("ran"))
threading.Thread(target=lambda: time.sleep(0.5) or open("thread.txt", "w").write("joined")).start()
sys.stdout.write("buffered, no newline")
sys.stderr.write("on stderr")
exit_without_finalizing(3)
sys.stdout.write("after the exit")
""",
        tmp_path,
    )
    assert result.returncode == 3, result.stderr
    assert result.stdout == "buffered, no newline"  # flushed, and neither finalization nor later code ran
    assert result.stderr.endswith("on stderr")  # after whatever the imports warned
    assert (tmp_path / "atexit.txt").read_text() == "ran"
    assert (tmp_path / "thread.txt").read_text() == "joined"  # a thread that is not a daemon finished first


# A CLI run stood in for by `main`, inside a one-process gloo group or not, ending normally or by `sys.exit`.
CONSOLE = """
import torch
import lit_rl.cli as cli

def main(args):
    if {group}:
        torch.distributed.init_process_group("gloo", init_method="file://" + "{init}", rank=0, world_size=1)
    if {code} == "raise":
        raise RuntimeError("the run broke")
    if {code} is not None:
        sys.exit({code})  # an int, or a message

cli.main = main
cli.console_main([])
os.write(1, b" returned")
"""


@pytest.mark.slow
@pytest.mark.parametrize("group", [True, False])
@pytest.mark.parametrize("code", [None, 4, "raise", "a message"])
def test_console_main_skips_finalization_only_inside_a_process_group(tmp_path, group, code):
    result = run_python(CONSOLE.format(group=group, init=tmp_path / "init", code=repr(code)), tmp_path)
    if code == "raise":  # the traceback, then 1, as the interpreter does
        assert result.returncode == 1 and result.stderr.rstrip().endswith("RuntimeError: the run broke")
        assert result.stdout == ("" if group else "finalized")
        return
    if code == "a message":  # sys.exit("a message"): printed, then 1, as the interpreter does
        assert result.returncode == 1 and result.stderr.rstrip().endswith("a message")
        assert result.stdout == ("" if group else "finalized")
        return
    assert result.returncode == (code or 0), result.stderr
    if group:
        assert result.stdout == "", result.stdout  # ended inside console_main, before finalization
    elif code is None:
        assert result.stdout == " returnedfinalized"  # an ordinary return, then an ordinary exit
    else:
        assert result.stdout == "finalized"  # sys.exit, as without console_main
