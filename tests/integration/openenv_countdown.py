"""A small OpenEnv environment server for the tests, on loopback: `uvicorn tests.integration.openenv_countdown:app`.

It speaks openenv 0.10's wire format as `openenv/core/env_server/http_server.py` serves it: `GET /health`; the
WebSocket `/ws`, one environment per connection, where `{"type": "reset", "data": {...}}` and `{"type": "step",
"data": {<action>}}` are answered `{"type": "observation", "data": {"observation": {...}, "reward": r, "done": d}}`,
`{"type": "close"}` ends the session, a failure is answered `{"type": "error", "data": {"message": ..., "code":
...}}`, and a connection past the server's capacity gets a `CAPACITY_REACHED` error, then is closed. It is written
with FastAPI alone because openenv 0.10 cannot be installed beside vLLM 0.32 (its fastmcp needs mcp<2, vLLM
mcp>=2), and the suite needs vLLM; `lit_rl.envs.OpenEnv` was also run against openenv's own `create_app` server
(docs/openenv.md says with what).

The environment is the tests' `RowTurns` (`tests.integration.envs`): `reset(answer=...)` opens an episode of
2 + answer % 2 model turns (3 without an answer) and answers `{"text": "<turns>;"}`; each step takes
`{"message": <the model's turn>}` and answers `{"text": "<turns left>;"}` (the tiny model's characters) with reward
0.25 when the turn holds a digit, done after the last turn. Each session opened and closed is a line `open <pid>` /
`close <pid>` in the file `$OPENENV_COUNTDOWN_LOG` (when set), so a test can check that every episode's session was
released, and that the server is gone after the run.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any, Optional

from fastapi import FastAPI, WebSocket, WebSocketDisconnect

_lock = threading.Lock()


def _record(event: str) -> None:
    path = os.environ.get("OPENENV_COUNTDOWN_LOG")
    if path:
        with _lock, open(path, "a") as log:
            log.write(f"{event} {os.getpid()}\n")


class Countdown:
    """One session's environment: `reset` and `step` return what openenv's `serialize_observation` sends."""

    def __init__(self) -> None:
        self.turns, self.done_turns = 3, 0

    def reset(self, answer: Any = None, **kwargs: Any) -> dict[str, Any]:
        self.turns = 3 if answer is None else 2 + int(answer) % 2
        self.done_turns = 0
        return _observation(f"{self.turns};", None, False)

    def step(self, message: str) -> dict[str, Any]:
        self.done_turns += 1
        reward = 0.25 if any(c.isdigit() for c in message) else 0.0
        return _observation(f"{self.turns - self.done_turns};", reward, self.done_turns >= self.turns)


def _observation(text: str, reward: Any, done: bool) -> dict[str, Any]:
    return {"observation": {"text": text, "metadata": {}}, "reward": reward, "done": done, "metadata": {}}


def countdown_app(max_sessions: int) -> FastAPI:
    """The server, allowing `max_sessions` sessions at once."""
    app = FastAPI()
    sessions = {"active": 0}

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "healthy"}

    @app.websocket("/ws")
    async def session(websocket: WebSocket) -> None:
        await websocket.accept()
        if sessions["active"] >= max_sessions:
            refusal = f"Server at capacity: {sessions['active']}/{max_sessions} sessions active."
            await websocket.send_text(_error(refusal, "CAPACITY_REACHED"))
            await websocket.close()
            return
        sessions["active"] += 1
        env = Countdown()
        _record("open")
        try:
            while True:
                message = json.loads(await websocket.receive_text())
                kind = message.get("type")
                if kind == "close":
                    break
                try:
                    if kind == "reset":
                        answer = {"type": "observation", "data": env.reset(**message.get("data", {}))}
                    elif kind == "step":
                        refused = _action_errors(message["data"])
                        if refused:  # openenv validates the action against its model (extra fields forbidden)
                            await websocket.send_text(_error("Invalid message", "VALIDATION_ERROR", refused))
                            continue
                        answer = {"type": "observation", "data": env.step(**message["data"])}
                    else:
                        raise ValueError(f"Unknown message type: {kind}")
                    await websocket.send_text(json.dumps(answer))
                except (TypeError, ValueError, KeyError) as err:
                    await websocket.send_text(_error(str(err), "EXECUTION_ERROR"))
        except WebSocketDisconnect:
            pass
        finally:
            sessions["active"] -= 1
            _record("close")

    return app


def _error(message: str, code: str, errors: Optional[list] = None) -> str:
    data = {"message": message, "code": code, **({"errors": errors} if errors else {})}
    return json.dumps({"type": "error", "data": data})


def _action_errors(action: dict[str, Any]) -> list[dict[str, Any]]:
    """What pydantic says of an action that is not `{"message": str}`, as openenv forwards it (`e.errors()`)."""
    errors = [{"type": "missing", "loc": ["message"], "msg": "Field required"}] if "message" not in action else []
    extra = [{"type": "extra_forbidden", "loc": [name], "msg": "Extra inputs are not permitted"} for name in action]
    return errors + [e for e in extra if e["loc"] != ["message"]]


app = countdown_app(max_sessions=256)  # configs/grpo.yaml's validation batch
small_app = countdown_app(max_sessions=1)
