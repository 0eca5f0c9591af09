"""Environment calls off the training thread, concurrently, each with a time limit.

An episode's `reset` and `step` are the user's code: a sandbox call, an HTTP request, a tool. Run one after another
on the training thread, a batch of 64 episodes whose steps take 100 ms each waits 6.4 s per turn; run together, it
waits about 100 ms. `EnvironmentRunner.run(calls)` makes a batch of calls and returns their outcomes in order:

- a method defined `async def` is awaited on the runner's event loop (one daemon thread, started on first use);
- a plain method runs on a daemon worker thread, kept for the next call (starting a thread took about 0.2 ms
  here, as long as a fast environment step);
- at most `concurrency` calls run at once (1: one after another, in order), counted over every batch the runner
  has running, from any thread;
- each call has `timeout_s` from the moment it starts. One that overruns is answered `EnvCallTimeout`, never
  waited for: a coroutine is cancelled; a thread cannot be stopped in Python, so its worker keeps running the call
  (a daemon: it cannot keep the process from exiting) and leaves the pool until it returns. While
  `MAX_OVERRUNNING` such calls run, new plain calls are answered `EnvCallTimeout` without running, so they cannot
  pile up (the calls already running when that count is reached can still overrun: the bound is
  `MAX_OVERRUNNING + concurrency`). Tools' calls (`lit_rl.envs.tools`), which run inside steps, are counted apart
  (`tool_overrunning`), so that stuck tools cannot refuse the environments' own calls.

Calls of different episodes run at the same time, so environments must not share mutable state without a lock
(set `model.env.concurrency` to 1 for one call at a time). `async` methods run on one event loop: one that blocks
(a `time.sleep` instead of `await asyncio.sleep`) holds up the others and no time limit reaches it; its batch is
answered `EnvCallTimeout` once it could have finished (`loop_margin_s` past), and the loop is left to its thread.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import inspect
import queue
import threading
import time
from typing import Any, Callable, Optional, Sequence

from lit_rl.errors import ConfigError

MAX_OVERRUNNING = 8  # plain calls still running past their time limit, at most, in the whole process

Call = tuple[Callable[..., Any], tuple[Any, ...]]
Outcome = tuple[Any, Optional[BaseException]]  # a call's value, or the exception it raised


class EnvCallTimeout(Exception):
    """An environment call that ran past its time limit, or was not run because too many calls still overrun."""


def timed_out(timeout_s: float) -> EnvCallTimeout:
    """The outcome of a call that ran past `timeout_s`."""
    return EnvCallTimeout(f"timed out after {timeout_s:g} s")


class _Overrunning:
    """The plain calls that ran past their time limit and have not returned yet (process-wide), each by the event
    its worker sets when the call returns."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: list[threading.Event] = []

    def add(self, returned: threading.Event) -> None:
        with self._lock:
            self._calls.append(returned)

    def count(self) -> int:
        with self._lock:
            self._calls[:] = [returned for returned in self._calls if not returned.is_set()]
            return len(self._calls)


overrunning = _Overrunning()  # environments' reset and step calls
tool_overrunning = _Overrunning()  # tool calls (`lit_rl.envs.tools`), which run inside steps: counted apart
WORKER_IDLE_EXIT_S = 300.0  # a worker with no call for this long ends its thread


class _Workers:
    """Daemon threads that run plain calls one at a time and wait for the next; a call that finds none idle starts
    one. A worker whose call overruns is away until the call returns, then idles again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue] = []  # each idle worker's inbox

    def start(self, function: Callable[..., Any], args: tuple[Any, ...], deliver: Callable[[Outcome], None]):
        """Run `function(*args)` on a worker, which hands `deliver` (value, exception or None) when it returns;
        the event that is set then."""
        returned = threading.Event()
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._work, args=(inbox,), name="lit-rl-env-call", daemon=True).start()
        inbox.put((function, args, deliver, returned))
        return returned

    def _work(self, inbox: queue.SimpleQueue) -> None:
        while True:
            try:
                function, args, deliver, returned = inbox.get(timeout=WORKER_IDLE_EXIT_S)
            except queue.Empty:
                with self._lock:
                    if inbox in self._idle:  # nobody took it meanwhile: end
                        self._idle.remove(inbox)
                        return
                continue  # a call was handed to it as it timed out
            try:
                outcome: Outcome = (function(*args), None)
            except BaseException as err:  # the waiting side re-raises it
                outcome = (None, err)
            deliver(outcome)
            returned.set()
            del function, args, deliver, outcome  # hold nothing of the call while idle
            with self._lock:
                self._idle.append(inbox)


workers = _Workers()


def _refuse_while_overrunning(tracker: _Overrunning) -> None:
    if (running := tracker.count()) >= MAX_OVERRUNNING:
        raise EnvCallTimeout(f"{running} calls are still running past their time limit; not run")


def _outcome(
    returned: threading.Event, outcome: Optional[Outcome], timeout_s: float, tracker: Optional[_Overrunning] = None
) -> Any:
    """The value of a call that ended (its exception re-raised), or `EnvCallTimeout` for one still running
    (counted in `tracker`, `overrunning` by default)."""
    if outcome is None:
        (overrunning if tracker is None else tracker).add(returned)
        raise timed_out(timeout_s)
    value, error = outcome
    if error is not None:
        raise error
    return value


def _as_outcome(returned: threading.Event, outcome: Optional[Outcome], timeout_s: float) -> Any:
    """`_outcome` as `EnvironmentRunner.run` returns it: the value, or the exception instead of raising it."""
    try:
        return _outcome(returned, outcome, timeout_s)
    except BaseException as err:
        return err


def call_in_thread(function: Callable[..., Any], args: tuple[Any, ...], timeout_s: float, tracker: _Overrunning) -> Any:
    """`function(*args)` on a daemon worker (`workers`), waited for at most `timeout_s`: its value, its exception
    re-raised, or `EnvCallTimeout` (the call then goes on, counted in `tracker`). Refused with `EnvCallTimeout`
    while `MAX_OVERRUNNING` calls of `tracker` still overrun."""
    _refuse_while_overrunning(tracker)
    box: list[Outcome] = []
    returned = workers.start(function, args, box.append)
    returned.wait(min(timeout_s, threading.TIMEOUT_MAX))
    return _outcome(returned, box[0] if box else None, timeout_s, tracker)


def check_runner_settings(concurrency: int, timeout_s: float) -> None:
    """One-line errors for `model.env.concurrency` and `model.env.step_timeout_s` (finite: a deadline must be one
    the thread primitives take)."""
    if concurrency < 1:
        raise ConfigError(f"model.env.concurrency must be >= 1, got {concurrency}")
    if not 0 < timeout_s < 1e6:
        raise ConfigError(f"model.env.step_timeout_s must be > 0 and < 1e6 s, got {timeout_s}")


class EnvironmentRunner:
    """Runs environment calls concurrently off the caller's thread (module docstring).

    Args:
        concurrency: the most calls running at once (`model.env.concurrency`).
        timeout_s: the time limit of one call (`model.env.step_timeout_s`).
    """

    def __init__(self, concurrency: int, timeout_s: float) -> None:
        check_runner_settings(concurrency, timeout_s)
        self.concurrency, self.timeout_s = concurrency, timeout_s
        self.loop_margin_s = 5.0  # the event loop's own delay allowed past the calls' limits
        self._lock = threading.Lock()  # around the event loop's start, abandonment and close
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        # The bound holds across `run` calls made at once from several threads (asynchronous episodes reset the
        # next generation's environments while the worker steps this one's): plain calls and coroutines apart.
        self._slots = threading.Semaphore(concurrency)
        self._async_slots: Optional[asyncio.Semaphore] = None

    def run(self, calls: Sequence[Call]) -> list[Any]:
        """Each call `(function, args)` made (module docstring); their outcomes in the order of `calls`: the value
        returned, or the exception raised (`EnvCallTimeout` for one that overran). Returns once every call has
        returned, raised or timed out."""
        outcomes: list[Any] = [None] * len(calls)
        awaited = [i for i, (function, _) in enumerate(calls) if inspect.iscoroutinefunction(function)]
        coroutines, loop = None, None
        if awaited:  # on the event loop, while this thread runs the plain ones
            batch = [calls[i] for i in awaited]
            loop = self._started_loop()
            coroutines = asyncio.run_coroutine_threadsafe(self._await_all(batch), loop)
        try:
            self._run_plain(calls, [i for i in range(len(calls)) if i not in set(awaited)], outcomes)
            if coroutines is not None:
                for i, outcome in zip(awaited, self._awaited_outcomes(coroutines, len(awaited), loop)):
                    outcomes[i] = outcome
        except BaseException:  # Ctrl-C: the coroutines are cancelled, not left running
            if coroutines is not None:
                coroutines.cancel()
            raise
        return outcomes

    def _awaited_outcomes(self, coroutines: Any, count: int, loop: asyncio.AbstractEventLoop) -> list[Any]:
        """The outcomes of a batch of `count` coroutines. Each has its own time limit once it holds a slot (the
        slots are shared with other batches, so it may first wait for one); so this waits as long as the event loop
        answers, checking it each `timeout_s + loop_margin_s`. An `async` method that blocks instead of awaiting
        holds the whole loop, where no time limit can reach it: then the loop does not answer within
        `loop_margin_s`, every call of the batch is answered `EnvCallTimeout`, and the loop is left to its thread
        (a new one serves the next batch)."""
        while True:
            try:
                outcomes = coroutines.result(timeout=min(self.timeout_s + self.loop_margin_s, threading.TIMEOUT_MAX))
                return [outcome.error if isinstance(outcome, _Raised) else outcome for outcome in outcomes]
            except concurrent.futures.TimeoutError:
                if self._answers(loop):
                    continue  # queued behind other batches' calls, or running within its limit
            coroutines.cancel()
            with self._lock:
                if self._loop is loop:
                    self._loop = self._thread = None  # blocked: abandoned, not joined
            return [
                EnvCallTimeout(
                    f"the event loop did not answer in {self.loop_margin_s:g} s past a call's limit of "
                    f"{self.timeout_s:g} s (an async method that blocks instead of awaiting?)"
                )
            ] * count

    def _answers(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Whether `loop` runs a no-op within `loop_margin_s`: not held by a blocking call, nor closed (`close`
        while a batch waits)."""
        if loop.is_closed():
            return False
        nothing = _nothing()
        try:
            probe = asyncio.run_coroutine_threadsafe(nothing, loop)
        except RuntimeError:  # closed since
            nothing.close()
            return False
        try:
            probe.result(timeout=self.loop_margin_s)
            return True
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
            probe.cancel()
            return False

    def _run_plain(self, calls: Sequence[Call], indices: list[int], outcomes: list[Any]) -> None:
        """Calls `indices` of `calls` on the workers, at most `concurrency` at once, their outcomes into
        `outcomes`. This thread hands them out and waits; an overrunning call is answered at its deadline."""
        returned_now: queue.SimpleQueue = queue.SimpleQueue()  # the index of each call as it returns
        running: dict[int, tuple[float, threading.Event, list[Outcome]]] = {}  # index: deadline, event, outcome
        waiting = collections.deque(indices)
        while waiting or running:
            # A slot of the runner's: without one, wait for one of this batch's calls, or (none running) for a slot
            # another thread's batch frees.
            while waiting and self._slots.acquire(blocking=not running):
                i = waiting.popleft()
                try:
                    _refuse_while_overrunning(overrunning)
                except EnvCallTimeout as refused:
                    self._slots.release()
                    outcomes[i] = refused
                    continue
                box: list[Outcome] = []

                def deliver(outcome: Outcome, i: int = i, box: list[Outcome] = box) -> None:
                    box.append(outcome)
                    returned_now.put(i)

                function, args = calls[i]
                returned = workers.start(function, args, deliver)
                running[i] = (time.monotonic() + self.timeout_s, returned, box)
            if not running:
                continue
            first_deadline = min(deadline for deadline, _, _ in running.values())
            try:
                i = returned_now.get(timeout=min(max(0.0, first_deadline - time.monotonic()), threading.TIMEOUT_MAX))
            except queue.Empty:  # past a deadline: those calls are answered now, and go on without a slot
                now = time.monotonic()
                for i, (deadline, returned, box) in list(running.items()):
                    if deadline <= now and not box:
                        del running[i]
                        self._slots.release()
                        outcomes[i] = _as_outcome(returned, None, self.timeout_s)
                continue
            if i in running:  # (a call answered at its deadline may still return later)
                _, returned, box = running.pop(i)
                self._slots.release()
                outcomes[i] = _as_outcome(returned, box[0], self.timeout_s)

    async def _await_all(self, calls: Sequence[Call]) -> list[Any]:
        if self._async_slots is None:  # on the loop's own thread: one semaphore for every batch it runs
            self._async_slots = asyncio.Semaphore(self.concurrency)
        slots = self._async_slots

        async def bounded(function: Callable[..., Any], args: tuple[Any, ...]) -> Any:
            async with slots:
                call = asyncio.ensure_future(_kept(function(*args)))
                done, _ = await asyncio.wait({call}, timeout=self.timeout_s)
                if done:
                    return call.result()
                # Cancelled, not awaited: a call that ignores its cancellation (or awaits forever in a `finally`)
                # is left running, as an overrunning plain call is, instead of holding its slot and this batch.
                call.cancel()
                call.add_done_callback(_retrieved)
                raise timed_out(self.timeout_s)

        return await asyncio.gather(*(bounded(f, a) for f, a in calls), return_exceptions=True)

    def _started_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                self._async_slots = None  # a new loop: a semaphore of its own (the last one's may be held forever)
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="lit-rl-env-loop", daemon=True)
                thread.start()
                self._loop, self._thread = loop, thread
            return self._loop

    def close(self) -> None:
        """Cancel what the event loop still runs, stop it and its thread (the workers stay for the next runner;
        calls still overrunning go on in theirs). A loop held by a blocking `async` method is left to its thread."""
        with self._lock:
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
        if loop is None or thread is None:
            return

        def cancel_and_stop() -> None:
            for task in asyncio.all_tasks(loop):
                task.cancel()
            loop.call_soon(loop.stop)  # after the cancelled tasks have run their cleanup once

        loop.call_soon_threadsafe(cancel_and_stop)
        thread.join(timeout=5.0)
        if not thread.is_alive():
            loop.close()


async def _nothing() -> None:
    """The event loop's liveness probe."""


def _retrieved(call: "asyncio.Future[Any]") -> None:
    """Take an abandoned call's outcome, so that asyncio does not log it as never retrieved."""
    if not call.cancelled():
        call.exception()


async def _kept(coroutine: Any) -> Any:
    """`coroutine`'s value; a SystemExit or KeyboardInterrupt it raises is returned as its outcome instead of
    escaping: asyncio re-raises those out of the event loop, which would end the loop's thread and leave the
    trainer waiting."""
    try:
        return await coroutine
    except (SystemExit, KeyboardInterrupt) as err:
        return _Raised(err)


class _Raised:
    """A SystemExit or KeyboardInterrupt that an `async` method raised, kept as a value (`_kept`)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error
