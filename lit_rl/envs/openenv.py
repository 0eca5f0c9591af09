"""OpenEnv environments (`pip install "lit-rl[openenv]"`, which adds `websockets`): each episode one session of an
OpenEnv server.

    model:
      env:
        environment: lit_rl.envs.OpenEnv
        environment_args:
          url: http://127.0.0.1:8000   # a server already running (loopback by default), or
          app: my_env.server.app:app   # lit-rl serves this app on 127.0.0.1 itself and stops it at the end
          app_python: null             # the Python that serves `app` (null: lit-rl's own)
          action_field: message        # the model's turn becomes the action {action_field: turn text}
          observation_field: null      # the observation's text: this field (null: its only text field)
          reset_args: {}               # keyword arguments of every reset (for example {difficulty: 2})
          row_reset_args: []           # row fields passed to reset by name (a task id, a seed)
          prompt: row                  # row: the row's prompt; reset: the reset observation's text is the prompt

An episode opens one WebSocket session (`/ws`: over plain HTTP each `/reset` and `/step` would get a fresh
environment), resets it, steps it once per model turn, and closes it when the episode ends (`close`, also after a
failure), so a server allowing N sessions runs N episodes at once. lit-rl speaks openenv 0.10's messages itself
(`{"type": "reset" | "step" | "close", "data": ...}`, answered `{"type": "observation", "data": {"observation": ...,
"reward": ..., "done": ...}}` or `{"type": "error", ...}`; `openenv/core/env_server/http_server.py`) rather than
import openenv's client: openenv 0.10 needs `mcp<2` (through fastmcp) and vLLM 0.32 `mcp>=2`, so they cannot share
an environment, and the server usually runs in its own (a container, a venv: `app_python`). Each step's
reward is summed into the reward part `openenv` (column `env/openenv`, weight 1; a null reward counts 0); the
server's `done` ends the episode. Observations go to the model as text: `observation_field`'s value, else the
observation's only text field (`metadata` aside), else all its fields as JSON.

Time limits and errors are those of every environment (`lit_rl.envs.runner`): a reset or step that overruns
`model.env.step_timeout_s` is cancelled and ends its episode. The connection is tried `max_retries` more times
(0.5 s, 1 s, ... apart) before the run stops with one line naming the URL; a step is never retried, since the
server's state has moved. A server error ends the run in one line with the server's message.

`app` (an import path `module:attribute` of an ASGI app, `create_app(...)`'s) is served by uvicorn (`app_python -m
uvicorn`, where openenv is installed) in a child process of the first environment built (at start-up, on the main
thread), on 127.0.0.1 and a free port, waited for until `/health` answers, shared by the process's episodes, and
stopped when the process exits (the kernel stops it if the trainer is killed). Its log is named in any error.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import threading
import urllib.parse
from pathlib import Path
from typing import Any, Optional

from lit_rl.envs.base import StepResult
from lit_rl.errors import ConfigError

REWARD_PART = "openenv"
MAX_MESSAGE_BYTES = 100 << 20  # openenv's client's limit: observations may hold screenshots or pages
AT_CAPACITY = (
    "each episode holds a session from its reset to its end, and the episodes of a batch (a rollout's rows x "
    "generations, a validation batch; with max_staleness > 0 every launched generation; every rank sharing the "
    "server) run at once: let the server allow as many (create_app(..., max_concurrent_envs=N))"
)
PROMPT_SOURCES = ("row", "reset")


class OpenEnv:
    """One episode on an OpenEnv server (module docstring); `model.env.environment_args` are its arguments."""

    reward_names = (REWARD_PART,)

    def __init__(
        self,
        url: Optional[str] = None,
        app: Optional[str] = None,
        app_python: Optional[str] = None,
        action_field: str = "message",
        observation_field: Optional[str] = None,
        reset_args: Optional[dict[str, Any]] = None,
        row_reset_args: Optional[list[str]] = None,
        prompt: str = "row",
        max_retries: int = 2,
        connect_timeout_s: float = 10.0,
        start_timeout_s: float = 60.0,
    ) -> None:
        if (url is None) == (app is None):
            raise ConfigError(
                "lit_rl.envs.OpenEnv needs exactly one of environment_args.url (a running server) and "
                "environment_args.app (an app lit-rl serves on 127.0.0.1)"
            )
        if prompt not in PROMPT_SOURCES:
            raise ConfigError(f"lit_rl.envs.OpenEnv environment_args.prompt must be row or reset, got {prompt!r}")
        if max_retries < 0:
            raise ConfigError(f"lit_rl.envs.OpenEnv environment_args.max_retries must be >= 0, got {max_retries}")
        _require_websockets()
        if url is not None:
            _check_url(url)
        self.url = url if app is None else LOCAL_APPS.url(app, app_python or sys.executable, start_timeout_s)
        self.action_field, self.observation_field = action_field, observation_field
        self.reset_args, self.row_reset_args = dict(reset_args or {}), list(row_reset_args or [])
        self.prompt, self.max_retries, self.connect_timeout_s = prompt, max_retries, connect_timeout_s
        self._socket: Any = None

    async def reset(self, row: dict[str, Any]) -> Optional[str]:
        """Open this episode's session and reset it with `reset_args` and the row's `row_reset_args`."""
        missing = [name for name in self.row_reset_args if name not in row]
        if missing:
            raise ValueError(f"environment_args.row_reset_args: the row has no field {missing[0]!r}")
        kwargs = {**self.reset_args, **{name: row[name] for name in self.row_reset_args}}
        await self._connect()
        try:
            observation, _, _ = await self.request({"type": "reset", "data": kwargs}, just_opened=True)
            return observation_text(observation, self.observation_field) if self.prompt == "reset" else None
        except Exception:  # a failed reset's episode is never closed by the rollout: free its session here
            await self.close()
            raise

    async def step(self, completion: str) -> StepResult:
        """The model's turn as the action `{action_field: completion}`: the server's observation, reward and done."""
        observation, reward, done = await self.request({"type": "step", "data": {self.action_field: completion}})
        text = observation_text(observation, self.observation_field)
        return StepResult(text, {REWARD_PART: reward}, done=done)

    async def close(self) -> None:
        """End the session (a `close` message, then the socket): the server frees its environment."""
        socket, self._socket = self._socket, None
        if socket is not None:
            try:
                await socket.send(json.dumps({"type": "close"}))
            except Exception:  # already closed by the server or the network: nothing is left to free
                pass
            finally:
                await socket.close()

    async def _connect(self) -> None:
        from websockets.asyncio.client import connect
        from websockets.exceptions import WebSocketException

        url = session_url(self.url)
        for attempt in range(self.max_retries + 1):
            try:
                # No proxy from the environment (only the URL the config names), no time limit of its own on an
                # answer: a call's limit is model.env.step_timeout_s (the runner's), whose overrun ends the episode.
                self._socket = await connect(
                    url, open_timeout=self.connect_timeout_s, max_size=MAX_MESSAGE_BYTES, proxy=None
                )
                return
            except (OSError, TimeoutError, WebSocketException) as err:
                if attempt == self.max_retries:
                    tries = f"{attempt + 1} tr{'y' if attempt == 0 else 'ies'} of {self.connect_timeout_s:g} s"
                    raise ConnectionError(
                        f"OpenEnv server {self.url} did not answer ({tries}): {one_line(err)}"
                    ) from None
                await asyncio.sleep(0.5 * 2**attempt)

    async def request(self, message: dict[str, Any], just_opened: bool = False) -> tuple[dict[str, Any], Any, Any]:
        """One message of the session and its answer: (observation, reward, done); a failure as one line naming
        the server. A session the server or the network closed is not reopened: that would be a fresh environment,
        never reset. `just_opened`: the first message, whose answer may be the server's refusal, already sent."""
        from websockets.exceptions import ConnectionClosed, WebSocketException
        from websockets.protocol import State

        socket = self._socket
        if socket is None or (socket.state is not State.OPEN and not just_opened):
            closed = "the episode's session was closed (by the server or the network)"
            raise RuntimeError(f"OpenEnv server {self.url}: {closed}")
        try:
            try:
                await socket.send(json.dumps(message))
            except ConnectionClosed:  # a refused session (at capacity) sends its error, then closes: read it
                pass
            answer = json.loads(await socket.recv())
        except asyncio.CancelledError:  # past its time limit: its answer may still come, so the socket is done
            self._socket = None
            closing = asyncio.ensure_future(socket.close())
            _CLOSING.add(closing)  # kept until done: the loop holds tasks only weakly
            closing.add_done_callback(_CLOSING.discard)
            raise
        except (OSError, WebSocketException, ValueError) as err:  # ValueError: not JSON, or not UTF-8
            raise RuntimeError(f"OpenEnv server {self.url}: {one_line(err)}") from None
        return self._answer(answer)

    def _answer(self, answer: Any) -> tuple[dict[str, Any], float, bool]:
        """An answer's (observation, reward, done), a null reward as 0; an error answer or a malformed one raised
        as one line naming the server."""
        data = answer.get("data") if isinstance(answer, dict) else None
        if not isinstance(data, dict):
            raise RuntimeError(f"OpenEnv server {self.url}: an answer without data: {one_line(str(answer))}")
        if answer.get("type") == "error":
            error = f"{one_line(str(data.get('message', 'unknown error')))} (code: {data.get('code', 'UNKNOWN')})"
            if data.get("code") == "CAPACITY_REACHED":  # every episode holds its session from reset to its end
                error += f"; {AT_CAPACITY}"
            if data.get("code") == "VALIDATION_ERROR":  # the action (or reset) the server's model refused
                problems = [f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')}" for e in data.get("errors", [])]
                error += f": {'; '.join(problems[:3])} (the action is {{environment_args.action_field: turn}})"
            raise RuntimeError(f"OpenEnv server {self.url}: {error}")
        observation, reward = data.get("observation") or {}, data.get("reward")
        if not isinstance(observation, dict) or not (reward is None or isinstance(reward, (int, float))):
            raise RuntimeError(f"OpenEnv server {self.url}: a malformed observation: {one_line(str(data))}")
        return observation, float(reward or 0.0), bool(data.get("done", False))


def observation_text(observation: dict[str, Any], field: Optional[str]) -> str:
    """The text the model reads for an observation (module docstring)."""
    fields = {name: value for name, value in observation.items() if name != "metadata"}
    if field is not None:
        if field not in observation:
            has = ", ".join(sorted(fields))
            raise ValueError(
                f"environment_args.observation_field: the observation has no field {field!r} (it has {has})"
            )
        value = observation[field]
        return value if isinstance(value, str) else json.dumps(value)
    texts = [value for value in fields.values() if isinstance(value, str)]
    return texts[0] if len(texts) == 1 else json.dumps(fields, sort_keys=True)


_CLOSING: set[Any] = set()  # sockets closing in the background after a cancelled call


def _check_url(url: str) -> None:
    """A one-line error unless `url` is an http(s) or ws(s) URL."""
    if urllib.parse.urlsplit(url).scheme.lower() not in ("http", "https", "ws", "wss") or "?" in url:
        raise ConfigError(f"lit_rl.envs.OpenEnv environment_args.url must be http(s)://host:port[/path], got {url!r}")


def session_url(url: str) -> str:
    """The session endpoint of the server at `url`: http -> ws, https -> wss, then `/ws`."""
    parts = urllib.parse.urlsplit(url)
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme.lower(), parts.scheme.lower())
    return urllib.parse.urlunsplit((scheme, parts.netloc, parts.path.rstrip("/") + "/ws", "", ""))


def _require_websockets() -> None:
    try:
        import websockets  # noqa: F401
    except ImportError:
        raise ConfigError('lit_rl.envs.OpenEnv needs websockets: pip install "lit-rl[openenv]"') from None


def one_line(err: BaseException) -> str:
    text = str(err).strip()
    return (text.splitlines()[0] if text else type(err).__name__)[:300]


# uvicorn serving `app` (argv: app, host, port), with the working directory last on the import path, where the
# app's own module is found: `python -m uvicorn` puts it first, so a stray `websockets.py` beside the run would stand
# in for the installed package. (`python -c` puts it first too; PYTHONSAFEPATH=1 does not before Python 3.11.)
_SERVE_APP = (
    "import os, sys; here = os.getcwd(); sys.path[:] = [p for p in sys.path if p not in ('', '.', here)] + [here]; "
    "import uvicorn; uvicorn.run(sys.argv[1], host=sys.argv[2], port=int(sys.argv[3]))"
)


class _LocalApps:
    """The OpenEnv apps this process serves (`app`), by import path: started once, stopped at exit."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._urls: dict[str, str] = {}

    def url(self, app: str, python: str, timeout_s: float) -> str:
        with self._lock:  # one server per app, however many episodes' environments are built at once
            if app not in self._urls:
                self._urls[app] = self._start(app, python, timeout_s)
            return self._urls[app]

    def _start(self, app: str, python: str, timeout_s: float) -> str:
        from lit_rl.rollout.server.client import _last_error, start_server_child

        if ":" not in app:
            raise ConfigError(f"lit_rl.envs.OpenEnv environment_args.app must be module:attribute, got {app!r}")
        log_path = str(Path(tempfile.mkdtemp(prefix="lit-rl-openenv-")) / "server.log")
        command = lambda port: ([python, "-c", _SERVE_APP, app, "127.0.0.1", str(port)], {})  # noqa: E731
        # No vLLM server: its health poll carries no VLLM_API_KEY. Stopped at exit at the latest.
        child, failure = start_server_child(command, log_path, timeout_s, api_key=False)
        if failure is not None:
            raise ConfigError(
                f"lit_rl.envs.OpenEnv: the server of {app} {failure} ({_last_error(log_path)}); its log: {log_path}"
            )
        return child.url


LOCAL_APPS = _LocalApps()
