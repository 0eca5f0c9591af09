"""Asynchronous reward functions (awaited together) and rewards served over HTTP (`lit_rl.rewards.http`): batched
calls, retries, time limits and one-line errors naming the URL."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from lit_rl.errors import RewardFunctionError
from lit_rl.rewards import import_reward_function, log_extra, log_metric, reward_name
from lit_rl.rewards.http import HTTPReward
from lit_rl.rewards.scorer import call_reward_functions
from lit_rl.rollout.server.client import free_port


def test_async_reward_functions_score_the_batch_concurrently():
    """Each function waits for the other to have started: awaited one after the other, neither would finish."""
    started: dict[str, asyncio.Event] = {}  # made inside the event loop that awaits them

    async def meet(me: str, other: str) -> None:
        started.setdefault(me, asyncio.Event()).set()
        await asyncio.wait_for(started.setdefault(other, asyncio.Event()).wait(), timeout=5)

    async def first(prompts, completions, **_):
        await meet("first", "second")
        return [1.0 for _ in completions]

    async def second(prompts, completions, **_):
        await meet("second", "first")
        return [len(c) for c in completions]

    def plain(prompts, completions, **_):
        return [0.5 for _ in completions]

    values = call_reward_functions({"first": first, "plain": plain, "second": second}, ["p", "q"], ["a", "bcd"], {})
    assert values == [[1.0, 1.0], [0.5, 0.5], [1.0, 3.0]]

    async def broken(prompts, completions, **_):
        raise KeyError("judge")

    with pytest.raises(RewardFunctionError, match="reward function 'broken' raised KeyError"):
        call_reward_functions({"broken": broken}, ["p"], ["a"], {})

    async def no_columns(prompts, completions):
        return [1.0]

    async def not_a_list(prompts, completions, **_):
        return 1.0

    with pytest.raises(RewardFunctionError, match="reward function 'no_columns' raised TypeError"):
        call_reward_functions({"first": first, "no_columns": no_columns}, ["p"], ["a"], {"answer": ["1"]})
    with pytest.raises(RewardFunctionError, match="reward function 'not_a_list' returned 1.0, not a list of numbers"):
        call_reward_functions({"not_a_list": not_a_list}, ["p"], ["a"], {})


def test_an_object_with_an_async_call_is_awaited_with_the_async_functions():
    """`inspect.iscoroutinefunction` is False on an object whose `__call__` is `async def`: it was called as a sync
    function, and 'raised TypeError: 'coroutine' object is not iterable'. The judge waits for `first` to have
    started: were they not awaited together, it would not finish."""
    events: dict[str, asyncio.Event] = {}  # made inside the event loop that awaits them

    class Judge:
        async def __call__(self, prompts, completions, **_):
            await asyncio.wait_for(events.setdefault("first", asyncio.Event()).wait(), timeout=5)
            return [float(len(c)) for c in completions]

    async def first(prompts, completions, **_):
        events.setdefault("first", asyncio.Event()).set()
        return [1.0 for _ in completions]

    values = call_reward_functions({"judge": Judge(), "first": first}, ["p", "q"], ["a", "bcd"], {})
    assert values == [[1.0, 3.0], [1.0, 1.0]]


class _Server:
    """A reward server on 127.0.0.1: reward = len(completion) + len(answer column); it fails the first
    `failures` requests with HTTP 503, sleeps `delay` seconds per request, and records each batch size."""

    def __init__(self, failures: int = 0, delay: float = 0.0) -> None:
        self.batches, self.failures, self.delay = [], failures, delay
        state = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if state.failures > 0:
                    state.failures -= 1
                    self.send_response(503)
                    self.end_headers()
                    return
                threading.Event().wait(state.delay)
                state.batches.append(len(body["completions"]))
                rewards = [len(c) + len(a) for c, a in zip(body["completions"], body["columns"]["answer"])]
                data = json.dumps({"rewards": rewards}).encode()
                try:
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except BrokenPipeError:  # the client gave up (the timeout test)
                    pass

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/score"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_an_http_reward_is_scored_in_batches_by_the_server():
    server = _Server()
    try:
        reward = import_reward_function(server.url)
        assert reward_name(server.url) == "score" and isinstance(reward, HTTPReward)
        reward.batch_size = 4
        completions = [str(i) for i in range(10)]
        # TRL's logging hooks are functions of this process: not sent (slicing them per batch raised TypeError).
        columns = {"answer": ["ab"] * 10, "log_extra": log_extra, "log_metric": log_metric}
        values = call_reward_functions({"score": reward}, ["p"] * 10, completions, columns)
        assert values == [[3.0] * 10] and sorted(server.batches) == [2, 4, 4]
    finally:
        server.close()


def test_an_http_reward_retries_a_failing_server_then_names_the_url():
    server = _Server(failures=1)
    try:
        assert HTTPReward(server.url, max_retries=1)(["p"], ["abc"], answer=["x"]) == [4]
        server.failures = 5
        named = r"reward server http://127.0.0.1:\d+/score: HTTP 503 after 2 tries"
        with pytest.raises(RewardFunctionError, match=named):
            HTTPReward(server.url, max_retries=1)(["p"], ["abc"], answer=["x"])
    finally:
        server.close()
    slow = _Server(delay=1.0)
    try:
        with pytest.raises(RewardFunctionError, match="timed out after 1 try"):
            HTTPReward(slow.url, timeout_s=0.2, max_retries=0)(["p"], ["abc"], answer=["x"])
    finally:
        slow.close()
    down = f"http://127.0.0.1:{free_port()}/score"
    with pytest.raises(RewardFunctionError, match=rf"reward server {down}: unreachable"):
        call_reward_functions({"score": HTTPReward(down, max_retries=0)}, ["p"], ["a"], {"answer": ["x"]})


def test_two_urls_of_one_name_are_told_apart_by_their_address():
    """A URL's name is its last path segment, and names must be unique: two servers of `/score` could not be used
    together (a function can be renamed, a URL cannot)."""
    from lit_rl.config import RewardArgs
    from lit_rl.rewards.scorer import RewardScorer

    urls = ["http://127.0.0.1:8000/score", "http://127.0.0.1:8001/score", "http://judge.local/grade"]
    scorer = RewardScorer(RewardArgs(funcs=urls))
    assert scorer.names == ["score_127_0_0_1_8000", "score_127_0_0_1_8001", "grade"]
    assert RewardScorer(RewardArgs(funcs=urls[:1])).names == ["score"]
