"""OpenEnv environments (`pip install "lit-rl[openenv]"`): each episode one session of an OpenEnv server.

    model:
      env:
        environment: lit_rl.envs.OpenEnv
        environment_args:
          url: http://127.0.0.1:8000   # a server already running (loopback by default), or
          app: my_env.server.app:app   # lit-rl serves this app on 127.0.0.1 itself and stops it at the end
          action_field: message        # the model's turn becomes the action {action_field: turn text}
          observation_field: null      # the observation's text: this field (null: its only text field)
          reset_args: {}               # keyword arguments of every reset (for example {difficulty: 2})
          row_reset_args: []           # row fields passed to reset by name (a task id, a seed)
          prompt: row                  # row: the row's prompt; reset: the reset observation's text is the prompt

An episode opens one WebSocket session (`/ws`, through openenv's own `GenericEnvClient`: over plain HTTP each
`/reset` and `/step` would get a fresh environment), resets it, steps it once per model turn, and closes it when the
episode ends (`close`, also after a failure), so a server allowing N sessions runs N episodes at once. Each step's
reward is summed into the reward part `openenv` (column `env/openenv`, weight 1; a null reward counts 0); the
server's `done` ends the episode. Observations go to the model as text: `observation_field`'s value, else the
observation's only text field (`metadata` aside), else all its fields as JSON.

Time limits and errors are those of every environment (`lit_rl.envs.runner`): a reset or step that overruns
`model.env.step_timeout_s` is cancelled and ends its episode. The connection is tried `max_retries` more times
(0.5 s, 1 s, ... apart) before the run stops with one line naming the URL; a step is never retried, since the
server's state has moved. A server error ends the run in one line with the server's message.

`app` (an import path `module:attribute` of an ASGI app, `create_app(...)`'s) is served by uvicorn in a child process
of the first environment built (at start-up, on the main thread), on 127.0.0.1 and a free port, waited for until
`/health` answers, shared by the process's episodes, and stopped when the process exits (the kernel stops it if the
trainer is killed). Its log is named in any error.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import threading
import time
import urllib.error
import weakref
from pathlib import Path
from typing import Any, Optional

from lit_rl.envs.base import StepResult
from lit_rl.errors import ConfigError

REWARD_PART = "openenv"
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
        _require_openenv()
        self.url = url if app is None else LOCAL_APPS.url(app, start_timeout_s)
        self.action_field, self.observation_field = action_field, observation_field
        self.reset_args, self.row_reset_args = dict(reset_args or {}), list(row_reset_args or [])
        self.prompt, self.max_retries, self.connect_timeout_s = prompt, max_retries, connect_timeout_s
        self._client: Any = None

    async def reset(self, row: dict[str, Any]) -> Optional[str]:
        """Open this episode's session and reset it with `reset_args` and the row's `row_reset_args`."""
        missing = [name for name in self.row_reset_args if name not in row]
        if missing:
            raise ValueError(f"environment_args.row_reset_args: the row has no field {missing[0]!r}")
        kwargs = {**self.reset_args, **{name: row[name] for name in self.row_reset_args}}
        await self._connect()
        result = await self._send(self._client.reset(**kwargs))
        return observation_text(result.observation, self.observation_field) if self.prompt == "reset" else None

    async def step(self, completion: str) -> StepResult:
        """The model's turn as the action `{action_field: completion}`: the server's observation, reward and done."""
        if not _session_open(self._client):  # openenv would reconnect to a fresh, un-reset environment
            raise RuntimeError(
                f"OpenEnv server {self.url}: the episode's session was closed (by the server or the network)"
            )
        result = await self._send(self._client.step({self.action_field: completion}))
        text = observation_text(result.observation, self.observation_field)
        return StepResult(text, {REWARD_PART: float(result.reward or 0.0)}, done=bool(result.done))

    async def close(self) -> None:
        """End the session: the server frees its environment."""
        client, self._client = self._client, None
        if client is not None:
            await client.close()

    async def _connect(self) -> None:
        from openenv.core.generic_client import GenericEnvClient

        for attempt in range(self.max_retries + 1):
            # No time limit of openenv's on an answer: a call's limit is model.env.step_timeout_s (the runner's),
            # whose overrun ends the episode; openenv's (60 s) would stop the run instead.
            client = GenericEnvClient(
                base_url=self.url, connect_timeout_s=self.connect_timeout_s, message_timeout_s=None
            )
            try:
                await client.connect()
            except ConnectionError as err:
                if attempt == self.max_retries:
                    tries = f"{attempt + 1} tr{'y' if attempt == 0 else 'ies'} of {self.connect_timeout_s:g} s"
                    raise ConnectionError(
                        f"OpenEnv server {self.url} did not answer ({tries}): {_one_line(err)}"
                    ) from None
                await asyncio.sleep(0.5 * 2**attempt)
            else:
                self._client = client
                return

    async def _send(self, call: Any) -> Any:
        """A reset or step of the session, its failure as one line naming the server."""
        from websockets.exceptions import WebSocketException

        try:
            return await call
        except (RuntimeError, ConnectionError, OSError, WebSocketException) as err:
            message = _one_line(err)
            if "CAPACITY_REACHED" in message:  # every episode of a batch holds its session from reset to its end
                message += f"; {AT_CAPACITY}"
            raise RuntimeError(f"OpenEnv server {self.url}: {message}") from None


def _session_open(client: Any) -> bool:
    """Whether openenv's client still holds the session's socket (openenv 0.10's `_ws`, pinned by the extra)."""
    from websockets.protocol import State

    socket = getattr(client, "_ws", None)
    return socket is not None and socket.state is State.OPEN


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


def _require_openenv() -> None:
    try:
        import openenv.core.generic_client  # noqa: F401
    except ImportError:
        raise ConfigError('lit_rl.envs.OpenEnv needs openenv: pip install "lit-rl[openenv]"') from None


def _one_line(err: BaseException) -> str:
    text = str(err).strip()
    return (text.splitlines()[0] if text else type(err).__name__)[:300]


class _LocalApps:
    """The OpenEnv apps this process serves (`app`), by import path: started once, stopped at exit."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._urls: dict[str, str] = {}
        self._stops: list[weakref.finalize] = []

    def url(self, app: str, timeout_s: float) -> str:
        with self._lock:  # one server per app, however many episodes' environments are built at once
            if app not in self._urls:
                self._urls[app] = self._start(app, timeout_s)
            return self._urls[app]

    def _start(self, app: str, timeout_s: float) -> str:
        from lit_rl.rollout.server.client import _last_error, _stop_session, free_port, start_child

        if ":" not in app:
            raise ConfigError(f"lit_rl.envs.OpenEnv environment_args.app must be module:attribute, got {app!r}")
        port = free_port()
        log_path = str(Path(tempfile.mkdtemp(prefix="lit-rl-openenv-")) / "server.log")
        argv = [sys.executable, "-m", "uvicorn", app, "--host", "127.0.0.1", "--port", str(port)]
        process, log = start_child(argv, {}, log_path)
        stop = weakref.finalize(process, _stop_session, process, log)
        self._stops.append(stop)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout_s
        while not (_healthy(url) and process.poll() is None):  # a server that exited did not answer: another did
            if process.poll() is not None or time.monotonic() > deadline:
                code = process.poll()
                stop()
                what = f"exited with code {code}" if code is not None else f"did not answer within {timeout_s:g} s"
                raise ConfigError(
                    f"lit_rl.envs.OpenEnv: the server of {app} {what} ({_last_error(log_path)}); its log: {log_path}"
                )
            time.sleep(0.2)
        return url


def _healthy(url: str) -> bool:
    from lit_rl.net import DIRECT

    try:
        with DIRECT.open(f"{url}/health", timeout=2.0) as answer:
            return answer.status == 200
    except (urllib.error.URLError, OSError):
        return False


LOCAL_APPS = _LocalApps()
