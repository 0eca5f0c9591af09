"""A process that ran collectives ends without the interpreter's finalization (`exit_without_finalizing`), where
torch 2.13's process-group threads can abort a finished run: what still runs (threads joined, atexit handlers,
flushed streams, the exit code) and what no longer does (finalization)."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import cli_env

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
        env=cli_env(),  # the repository on the path: `benchmarks.process_exit`
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_exit_without_finalizing_joins_threads_runs_the_atexit_handlers_flushes_and_exits_with_the_code(tmp_path):
    result = run_python(
        """
import atexit, threading, time
from benchmarks.process_exit import exit_without_finalizing
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


def test_the_interpreter_exit_steps_join_threads_then_run_the_atexit_handlers():
    script = """
import atexit, threading, time
from benchmarks.process_exit import run_interpreter_exit_steps
order = []
threading.Thread(target=lambda: (time.sleep(0.2), order.append("thread"))).start()
atexit.register(lambda: print(",".join(order + ["atexit"]), flush=True))
run_interpreter_exit_steps()
import os; os._exit(0)
"""
    result = subprocess.run([sys.executable, "-c", script], env=cli_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "thread,atexit", result.stderr[-2000:]
