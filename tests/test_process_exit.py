"""A process that ran collectives ends without the interpreter's finalization (`exit_without_finalizing`), where
torch 2.13's process-group threads can abort a finished run: what still runs (threads joined, atexit handlers,
flushed streams, the exit code) and what no longer does (finalization)."""

from __future__ import annotations

import subprocess
import sys

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
from lit_rl.training.strategies import exit_without_finalizing
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
