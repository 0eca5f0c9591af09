"""OpenEnv's MCP tool environments (an `MCPEnvironment` served by openenv 0.10's `create_app`): the server's tools
offered to the model in its chat format, each call of a turn one action of the episode's session.

    model:
      env:
        environment: lit_rl.envs.OpenEnvTools
        environment_args:
          url: http://127.0.0.1:8000   # a server already running, or
          app: my_env.server.app:app   # an app lit-rl serves on 127.0.0.1 (as `lit_rl.envs.OpenEnv`)
          row_reset_args: [task_id]    # row fields passed to reset by name

The tools are listed once per server, when the run builds its environments: a JSON-RPC `tools/list` over a session
of its own (`{"type": "mcp", "data": {"jsonrpc": "2.0", "method": "tools/list", "id": 1}}`, which needs no reset);
each tool's `inputSchema` becomes the JSON schema the chat template puts in the prompt (`lit_rl.envs.chat_tools`).
An episode is a session of the server as for `lit_rl.envs.OpenEnv` (opened and reset with the row, closed at the
end). Each call the model writes in its chat format is the step action `{"type": "call_tool", "tool_name": name,
"arguments": {...}}`, openenv's `CallToolAction`, sent in the turn's order: a step, not JSON-RPC `tools/call`, so the
environment's own `step` runs and answers with a reward and `done` (JSON-RPC calls bypass it). The answer's
`CallToolObservation` goes back to the model as a `tool` message: the text of the result's content, else its data
as JSON; a framework error (`error`: unknown tool, invalid arguments, a timeout) or a result marked `is_error` as
`error: ...`, counted in `tool_errors`. The steps' rewards are summed into the reward part `openenv` (column
`env/openenv`, weight 1); the server's `done` ends the episode, and so does a turn without a call. Tested against a
server written in the tests in openenv's wire format (`tests/integration/openenv_tools.py`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
from typing import Any, Optional

from lit_rl.envs.base import StepResult
from lit_rl.envs.chat_tools import HERMES, ChatToolEnvironment, TemplateCalls
from lit_rl.envs.openenv import MAX_MESSAGE_BYTES, REWARD_PART, OpenEnv, one_line, session_url
from lit_rl.errors import ConfigError


class OpenEnvTools(ChatToolEnvironment):
    """One episode on an OpenEnv MCP tool environment (module docstring); `model.env.environment_args` are its
    arguments: those of `lit_rl.envs.OpenEnv` but the action and observation fields (the actions are tool calls).
    `call_format` and `template_calls` are set by lit-rl from the tokenizer's chat template."""

    reward_names = (REWARD_PART,)
    timeout_s = None  # a call is bounded by its step's time limit (model.env.step_timeout_s)

    def __init__(
        self,
        url: Optional[str] = None,
        app: Optional[str] = None,
        app_python: Optional[str] = None,
        reset_args: Optional[dict[str, Any]] = None,
        row_reset_args: Optional[list[str]] = None,
        prompt: str = "row",
        max_retries: int = 2,
        connect_timeout_s: float = 10.0,
        start_timeout_s: float = 60.0,
        call_format: str = HERMES,
        template_calls: Optional[TemplateCalls] = None,
    ) -> None:
        self.take_call_format(call_format, template_calls)
        self.session = OpenEnv(
            url,
            app,
            app_python,
            reset_args=reset_args,
            row_reset_args=row_reset_args,
            prompt=prompt,
            max_retries=max_retries,
            connect_timeout_s=connect_timeout_s,
            start_timeout_s=start_timeout_s,
        )
        self.schemas = SERVER_TOOLS.schemas(self.session.url, connect_timeout_s, max_retries)
        self.tools = {schema["function"]["name"]: schema for schema in self.schemas}

    async def reset(self, row: dict[str, Any]) -> Optional[str]:
        """Open this episode's session and reset it (`lit_rl.envs.OpenEnv.reset`)."""
        return await self.session.reset(row)

    async def step(self, completion: str) -> StepResult:
        """Each call of the turn as a `call_tool` action of the session, in order, answered with a `tool` message;
        the rewards summed; the server's `done` (or a turn without a call) ends the episode."""
        calls = self.read_calls(completion)
        if not calls:
            return StepResult(observation=None, done=True)
        messages, errors, reward = [], 0, 0.0
        for made, call in enumerate(calls, start=1):
            content, done = self.call_error(call), False
            failed = content is not None
            if content is None:
                action = {"type": "call_tool", "tool_name": call.name, "arguments": call.arguments}
                observation, step_reward, done = await self.session.request({"type": "step", "data": action})
                reward += step_reward
                content, failed = tool_result_text(observation)
            errors += int(failed)
            messages.append(self.tool_message(call, content))
            if done:
                break
        return StepResult(None if done else messages, {REWARD_PART: reward}, done, made, errors)

    async def close(self) -> None:
        await self.session.close()


def tool_result_text(observation: dict[str, Any]) -> tuple[str, bool]:
    """A `CallToolObservation` as the model reads it, and whether the call failed: `error: <type>: <message>` for a
    framework error, `error: <text>` for a result marked `is_error`; else the text of the result's content, else its
    data (or the result itself) as JSON."""
    error = observation.get("error")
    if error:
        kind = error.get("error_type", "error") if isinstance(error, dict) else "error"
        message = error.get("message", "") if isinstance(error, dict) else str(error)
        return f"error: {kind}: {message}", True
    result = observation.get("result")
    if isinstance(result, dict):
        texts = [part.get("text", "") for part in result.get("content") or [] if isinstance(part, dict)]
        text = "".join(texts) if any(texts) else json.dumps(result.get("data", result), default=str)
        failed = bool(result.get("is_error") or result.get("isError"))
        return (f"error: {text}" if failed else text), failed
    return (result if isinstance(result, str) else json.dumps(result, default=str)), False


class _ServerTools:
    """Each server's tools as chat-template schemas, listed once per process (the run's environments share them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._schemas: dict[str, list[dict[str, Any]]] = {}

    def schemas(self, url: str, timeout_s: float, max_retries: int) -> list[dict[str, Any]]:
        with self._lock:
            if url not in self._schemas:
                self._schemas[url] = _run_apart(_listed_tools(url, timeout_s, max_retries))
            return self._schemas[url]


def _run_apart(coroutine: Any) -> Any:
    """`coroutine`'s result, run in a new event loop (in a worker thread when this thread already runs one, as in a
    notebook)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


async def _listed_tools(url: str, timeout_s: float, max_retries: int) -> list[dict[str, Any]]:
    """The server's tools (JSON-RPC `tools/list` over a session of its own) as chat-template schemas; the connection
    tried `max_retries` more times, 0.5 s, 1 s, ... apart, as an episode's is (a server may still be starting)."""
    from websockets.asyncio.client import connect

    request = {"type": "mcp", "data": {"jsonrpc": "2.0", "method": "tools/list", "id": 1}}
    for attempt in range(max_retries + 1):
        try:
            opened = connect(session_url(url), open_timeout=timeout_s, max_size=MAX_MESSAGE_BYTES, proxy=None)
            async with opened as socket:
                await socket.send(json.dumps(request))
                answer = json.loads(await asyncio.wait_for(socket.recv(), timeout_s))
                await socket.send(json.dumps({"type": "close"}))
            break
        except (OSError, TimeoutError) as err:  # not answering yet: try again
            if attempt == max_retries:
                raise ConfigError(
                    f"lit_rl.envs.OpenEnvTools: listing the tools of {url} failed: {one_line(err)}"
                ) from None
            await asyncio.sleep(0.5 * 2**attempt)
        except Exception as err:
            raise ConfigError(f"lit_rl.envs.OpenEnvTools: listing the tools of {url} failed: {one_line(err)}") from None
    data = answer.get("data") if isinstance(answer, dict) else None
    result = data.get("result") if isinstance(data, dict) else None
    if not isinstance(data, dict) or answer.get("type") != "mcp" or not isinstance(result, dict) or data.get("error"):
        why = (data.get("error") or data.get("message")) if isinstance(data, dict) else answer
        raise ConfigError(
            f"lit_rl.envs.OpenEnvTools: {url} listed no tools (is it an MCP environment?): {one_line(str(why))}"
        )
    tools = result.get("tools") or []
    if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("name"), str) for t in tools):
        raise ConfigError(f"lit_rl.envs.OpenEnvTools: {url} listed tools without names: {one_line(str(tools))}")
    if not tools:
        raise ConfigError(f"lit_rl.envs.OpenEnvTools: {url} has no tools")
    return [_schema(tool) for tool in tools]


def _schema(tool: dict[str, Any]) -> dict[str, Any]:
    """An MCP tool (`name`, `description`, `inputSchema`; `input_schema` in openenv's own listing) as the JSON schema
    chat templates take (transformers' `get_json_schema` shape)."""
    parameters = tool.get("inputSchema") or tool.get("input_schema") or {"type": "object", "properties": {}}
    return {
        "type": "function",
        "function": {"name": tool["name"], "description": tool.get("description") or "", "parameters": parameters},
    }


SERVER_TOOLS = _ServerTools()
