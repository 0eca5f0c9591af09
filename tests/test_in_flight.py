"""The gate of in-flight weight updates (`lit_rl.rollout.in_flight`): a newer version waits for the turns under way,
holds back the turns that would start meanwhile, and tags every turn's tokens with the version that sampled them."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

from lit_rl.rollout.base import RolloutOutput
from lit_rl.rollout.in_flight import InFlightWeights, oldest_token_versions


class Engine:
    """Records loads and turns in order; a turn named in `held` waits until released."""

    def __init__(self) -> None:
        self.events: list[tuple[str, object]] = []
        self.loaded: list[int] = []
        self.held: dict[str, threading.Event] = {}
        self.started: dict[str, threading.Event] = {}
        self.lock = threading.Lock()

    def load(self, version: int) -> None:
        with self.lock:
            self.events.append(("load", version))
            self.loaded.append(version)

    def generate(self, name: str) -> RolloutOutput:
        self.started.setdefault(name, threading.Event()).set()
        if name in self.held:
            assert self.held[name].wait(10)
        with self.lock:
            self.events.append((name, self.loaded[-1]))
        ids = torch.ones(1, 3, dtype=torch.long)
        return RolloutOutput(ids, ids.float(), torch.zeros(1, 3))


def _version_1_staged_during_a_long_turn(pool: ThreadPoolExecutor) -> tuple[Engine, InFlightWeights, Future]:
    """A gate whose engine holds version 0 with a turn under way (it ends when `engine.held["long turn"]` is set),
    then version 1 staged: the engine, the gate and the long turn."""
    engine = Engine()
    gate = InFlightWeights(engine.load)
    gate.staged(0)
    engine.held["long turn"] = threading.Event()
    long_turn = pool.submit(gate.sample, engine.generate, "long turn")
    assert engine.started.setdefault("long turn", threading.Event()).wait(10)
    gate.staged(1)
    return engine, gate, long_turn


def test_a_newer_version_waits_for_the_turn_under_way_and_holds_back_turns_that_would_start():
    with ThreadPoolExecutor(2) as pool:
        engine, gate, long_turn = _version_1_staged_during_a_long_turn(pool)
        next_turn = pool.submit(gate.sample, engine.generate, "next turn")
        # The next turn may not start (nor the load happen) while the long turn is under way.
        assert not engine.started.setdefault("next turn", threading.Event()).wait(0.3)
        assert engine.events == [("load", 0)]
        engine.held["long turn"].set()
        long_out, next_out = long_turn.result(10), next_turn.result(10)
    assert engine.events == [("load", 0), ("long turn", 0), ("load", 1), ("next turn", 1)]
    assert long_out.token_versions.tolist() == [[0, 0, 0]] and next_out.token_versions.tolist() == [[1, 1, 1]]


def test_turns_of_one_version_run_side_by_side_and_the_newest_staged_version_is_loaded_once():
    engine = Engine()
    gate = InFlightWeights(engine.load)
    gate.staged(0)
    gate.staged(2)
    gate.staged(1)  # an older one staged late changes nothing: versions only grow
    engine.held = {"a": threading.Event(), "b": threading.Event()}
    with ThreadPoolExecutor(2) as pool:
        turns = [pool.submit(gate.sample, engine.generate, name) for name in ("a", "b")]
        assert engine.started.setdefault("a", threading.Event()).wait(10)
        assert engine.started.setdefault("b", threading.Event()).wait(10)  # both under way at once
        for event in engine.held.values():
            event.set()
        outs = [turn.result(10) for turn in turns]
    assert engine.loaded == [2] and all(out.token_versions.unique().tolist() == [2] for out in outs)


def test_replaced_weights_are_loaded_again_and_a_failed_load_fails_the_turn_that_tried_it():
    engine = Engine()
    gate = InFlightWeights(engine.load)
    gate.staged(3)
    gate.sample(engine.generate, "first")
    gate.weights_replaced()  # a plain push: the engine no longer holds version 3
    gate.sample(engine.generate, "second")
    assert engine.loaded == [3, 3]

    def broken(version: int) -> None:
        raise RuntimeError("server down")

    failing = InFlightWeights(broken)
    failing.staged(0)
    with pytest.raises(RuntimeError, match="server down"):
        failing.sample(engine.generate, "never")
    with pytest.raises(RuntimeError, match="before any weights were staged"):
        InFlightWeights(engine.load).sample(engine.generate, "too early")


def test_a_closed_engine_fails_the_turns_waiting_for_an_update_and_those_that_would_start():
    with ThreadPoolExecutor(2) as pool:
        engine, gate, long_turn = _version_1_staged_during_a_long_turn(pool)
        waiting = pool.submit(gate.sample, engine.generate, "waiting")
        gate.close()
        with pytest.raises(RuntimeError, match="the engine was closed"):
            waiting.result(10)
        engine.held["long turn"].set()
        assert long_turn.result(10).token_versions.unique().tolist() == [0]  # the turn under way ends as it began
    with pytest.raises(RuntimeError, match="the engine was closed"):
        gate.sample(engine.generate, "later")
    assert engine.loaded == [0]


def test_a_row_is_as_stale_as_its_oldest_sampled_token():
    versions = torch.tensor([[2, 2, -1, 3], [-1, -1, -1, -1]])
    sampled = torch.tensor([[1.0, 1.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    assert oldest_token_versions(versions, sampled, launched=1).tolist() == [2, 1]
