"""Environment calls off the training thread, concurrently, each with a time limit.

An episode's `reset` and `step` are the user's code: a sandbox call, an HTTP request, a tool. Run one after another
on the training thread, a batch of 64 episodes whose steps take 100 ms each waits 6.4 s per turn; run together, it
waits about 100 ms. `EnvironmentRunner.run(calls)` makes a batch of calls and returns their outcomes in order:

- a method defined `async def` is awaited on the runner's event loop (one daemon thread, started on first use);
- a plain method runs in a daemon thread of its own;
- at most `concurrency` calls run at once (1: one after another, in order);
- each call has `timeout_s` from the moment it starts. One that overruns is answered `EnvCallTimeout`, never
  waited for: a coroutine is cancelled; a thread cannot be stopped in Python, so it keeps running (it is a
  daemon: it cannot keep the process from exiting) and at most `MAX_OVERRUNNING` such threads live at once; past
  that, plain calls are answered `EnvCallTimeout` without running, so they cannot pile up.

Calls of different episodes run at the same time, so environments must not share mutable state without a lock
(set `model.env.concurrency` to 1 for one call at a time). `async` methods run on one event loop: one that blocks
(a `time.sleep` instead of `await asyncio.sleep`) holds up the others.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from typing import Any, Callable, Optional, Sequence

from lit_rl.errors import ConfigError

MAX_OVERRUNNING = 8  # plain calls still running past their time limit, at most, in the whole process

Call = tuple[Callable[..., Any], tuple[Any, ...]]
Outcome = tuple[Any, Optional[BaseException]]  # a call's value, or the exception it raised


class EnvCallTimeout(Exception):
    """An environment call that ran past its time limit, or was not run because too many calls still overrun."""


class _Overrunning:
    """The threads of plain calls that ran past their time limit and have not returned yet (process-wide)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def add(self, thread: threading.Thread) -> None:
        with self._lock:
            self._threads.append(thread)

    def count(self) -> int:
        with self._lock:
            self._threads[:] = [thread for thread in self._threads if thread.is_alive()]
            return len(self._threads)


overrunning = _Overrunning()


def _refuse_while_overrunning() -> None:
    if (running := overrunning.count()) >= MAX_OVERRUNNING:
        raise EnvCallTimeout(f"{running} calls are still running past their time limit; not run")


def _start_call(
    function: Callable[..., Any], args: tuple[Any, ...], name: str, deliver: Callable[[Outcome], None]
) -> threading.Thread:
    """`function(*args)` started in a daemon thread of its own, which hands `deliver` (value, exception or None)."""

    def call() -> None:
        try:
            outcome: Outcome = (function(*args), None)
        except BaseException as err:  # the waiting side re-raises it
            outcome = (None, err)
        deliver(outcome)

    worker = threading.Thread(target=call, name=name, daemon=True)
    worker.start()
    return worker


def _outcome(worker: threading.Thread, outcome: Optional[Outcome], timeout_s: float) -> Any:
    """The value of a call that ended (its exception re-raised), or `EnvCallTimeout` for one still running."""
    if outcome is None:
        overrunning.add(worker)
        raise EnvCallTimeout(f"timed out after {timeout_s:g} s")
    value, error = outcome
    if error is not None:
        raise error
    return value


def call_in_thread(
    function: Callable[..., Any], args: tuple[Any, ...], timeout_s: float, name: str = "lit-rl-env-call"
) -> Any:
    """`function(*args)` in a daemon thread of its own, waited for at most `timeout_s`: its value, its exception
    re-raised, or `EnvCallTimeout` (the thread then keeps running, `overrunning`). Refused with `EnvCallTimeout`
    while `MAX_OVERRUNNING` calls still overrun."""
    _refuse_while_overrunning()
    box: list[Outcome] = []
    worker = _start_call(function, args, name, box.append)
    worker.join(timeout_s)
    return _outcome(worker, box[0] if box else None, timeout_s)


class EnvironmentRunner:
    """Runs environment calls concurrently off the caller's thread (module docstring).

    Args:
        concurrency: the most calls running at once (`model.env.concurrency`).
        timeout_s: the time limit of one call (`model.env.step_timeout_s`).
    """

    def __init__(self, concurrency: int, timeout_s: float) -> None:
        if concurrency < 1:
            raise ConfigError(f"model.env.concurrency must be >= 1, got {concurrency}")
        if not timeout_s > 0:
            raise ConfigError(f"model.env.step_timeout_s must be > 0, got {timeout_s}")
        self.concurrency, self.timeout_s = concurrency, timeout_s
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None

    def run(self, calls: Sequence[Call]) -> list[Any]:
        """Each call `(function, args)` made (module docstring); their outcomes in the order of `calls`: the value
        returned, or the exception raised (`EnvCallTimeout` for one that overran). Returns once every call has
        returned, raised or timed out."""
        if not calls:
            return []
        return asyncio.run_coroutine_threadsafe(self._run_all(calls), self._started_loop()).result()

    async def _run_all(self, calls: Sequence[Call]) -> list[Any]:
        slots = asyncio.Semaphore(self.concurrency)

        async def bounded(function: Callable[..., Any], args: tuple[Any, ...]) -> Any:
            async with slots:
                return await self._call(function, args)

        return await asyncio.gather(*(bounded(f, a) for f, a in calls), return_exceptions=True)

    async def _call(self, function: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        if inspect.iscoroutinefunction(function):
            try:
                return await asyncio.wait_for(function(*args), self.timeout_s)
            except asyncio.TimeoutError:
                raise EnvCallTimeout(f"timed out after {self.timeout_s:g} s") from None
        _refuse_while_overrunning()
        loop = asyncio.get_running_loop()
        finished: asyncio.Future = loop.create_future()

        def deliver(outcome: Outcome) -> None:
            try:
                loop.call_soon_threadsafe(lambda: finished.done() or finished.set_result(outcome))
            except RuntimeError:  # the runner was closed while this call overran: nobody waits for it
                pass

        worker = _start_call(function, args, "lit-rl-env-call", deliver)
        try:
            outcome = await asyncio.wait_for(asyncio.shield(finished), self.timeout_s)
        except asyncio.TimeoutError:
            outcome = None
        return _outcome(worker, outcome, self.timeout_s)

    def _started_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="lit-rl-env-loop", daemon=True)
            thread.start()
            self._loop, self._thread = loop, thread
        return self._loop

    def close(self) -> None:
        """Stop the event loop and its thread (calls still overrunning keep their daemon threads)."""
        if self._loop is None:
            return
        loop, thread = self._loop, self._thread
        self._loop = self._thread = None
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()
