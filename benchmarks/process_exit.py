"""How the multi-process benchmark and test workers end: `exit_without_finalizing`, after a process group's
collectives. Only the workers use it (benchmarks import it as `from process_exit import ...`, tests as
`from benchmarks.process_exit import ...`); it imports nothing of lit-rl."""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def run_interpreter_exit_steps() -> None:
    """What CPython does at exit before it finalizes: join the threads that are not daemons (`threading._shutdown`,
    the first thing `Py_FinalizeEx` calls), then run the atexit handlers (`atexit._run_exitfuncs`). Both are
    private to Python: `tests/test_process_exit.py` checks they still do this."""
    import atexit
    import threading

    threading._shutdown()
    atexit._run_exitfuncs()


def exit_without_finalizing(code: int = 0) -> NoReturn:
    """End a process that ran collectives: the atexit handlers, then the streams flushed, then `os._exit(code)`,
    skipping the interpreter's finalization, where torch 2.13 can abort a run that finished.

    The abort (pytorch/pytorch#190489, open; "terminate called without an active exception", SIGABRT): a process
    group's worker thread drops its reference to a finished collective's tensors just after the caller's `wait()`
    returned. Dropping a tensor that has a Python object takes the GIL; once the interpreter is finalizing, a
    thread asking for the GIL is ended by `pthread_exit`, whose unwinding through a `noexcept` destructor calls
    `std::terminate`. ZeRO-3 on gloo hits it when a gather ends just before the process does.

    What the interpreter does before finalizing is done, in its order and while it is whole (so a worker thread
    waiting for the GIL gets it): threads that are not daemons are joined, then the atexit handlers run (Lightning
    destroying an NCCL group, logging, temporary directories, child processes). Nothing after them needs the GIL.

    Not for the `lit-rl` CLI: `os._exit` also skips the C++ static destructors, and vLLM's CPU engine frees its
    shared memory in one (a tensor-parallel run then leaves `/dev/shm/...-cpushm_<rank>` behind, and the next one
    fails with errno 17). It ends the multi-process benchmark and test workers, which run no vLLM: that is why it
    lives here, beside the benchmarks, and not in `lit_rl`.
    """
    run_interpreter_exit_steps()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can be said on it
            pass
    os._exit(code)
