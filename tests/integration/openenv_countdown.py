"""A small OpenEnv environment for the tests, served on loopback: `uvicorn tests.integration.openenv_countdown:app`.

The tests' `RowTurns` (`tests.integration.envs`) as an OpenEnv server: `reset(answer=...)` opens an episode of
2 + answer % 2 model turns (3 without an answer) and answers `{"text": "<turns>;"}`; each `step` takes
`{"message": <the model's turn>}` and answers `{"text": "<turns left>;"}` (the tiny model's characters) with reward
0.25 when the turn holds a digit, done after the last turn. Each session's environment opened and closed is a line
`open <pid>` / `close <pid>` in the file `$OPENENV_COUNTDOWN_LOG` (when set), so a test can check that every
episode's WebSocket session was released, and that the server is gone after the run.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Optional

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

_lock = threading.Lock()


def _record(event: str) -> None:
    path = os.environ.get("OPENENV_COUNTDOWN_LOG")
    if path:
        with _lock, open(path, "a") as log:
            log.write(f"{event} {os.getpid()}\n")


class CountdownAction(Action):
    message: str


class CountdownObservation(Observation):
    text: str = ""


class CountdownEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self.turns, self.done_turns = 3, 0
        self._state = State(episode_id=None, step_count=0)
        _record("open")

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any):
        self.turns = 2 + int(kwargs["answer"]) % 2 if "answer" in kwargs else 3
        self.done_turns = 0
        self._state = State(episode_id=episode_id, step_count=0)
        return CountdownObservation(text=f"{self.turns};")

    def step(self, action: CountdownAction, timeout_s: Optional[float] = None, **kwargs: Any):
        self.done_turns += 1
        self._state.step_count = self.done_turns
        reward = 0.25 if any(c.isdigit() for c in action.message) else 0.0
        done = self.done_turns >= self.turns
        return CountdownObservation(text=f"{self.turns - self.done_turns};", reward=reward, done=done)

    @property
    def state(self) -> State:
        return self._state

    def close(self) -> None:
        _record("close")


app = create_app(
    CountdownEnvironment, CountdownAction, CountdownObservation, max_concurrent_envs=256
)  # configs/grpo.yaml's validation batch
small_app = create_app(CountdownEnvironment, CountdownAction, CountdownObservation, max_concurrent_envs=1)
