"""A small OpenEnv MCP tool environment for the tests, on loopback: `uvicorn tests.integration.openenv_tools:app`.

It answers as openenv 0.10's `create_app(MyMCPEnvironment, CallToolAction, CallToolObservation)` does over the
WebSocket `/ws` (`openenv/core/env_server/http_server.py`, `mcp_types.py`): `{"type": "mcp", "data": {JSON-RPC
tools/list}}` is answered `{"type": "mcp", "data": {"jsonrpc": "2.0", "result": {"tools": [{"name", "description",
"inputSchema"}]}, "error": null, "id": ...}}`; `{"type": "reset", "data": {...}}` and `{"type": "step", "data":
{"type": "call_tool", "tool_name": ..., "arguments": {...}}}` are answered `{"type": "observation", "data":
{"observation": {"tool_name", "result", "error", "metadata"}, "reward": r, "done": d}}`, a result as fastmcp's
`CallToolResult` serialised (`content` text parts, `data`, `is_error`), a framework error as `error: {"error_type",
"message"}`. Written with FastAPI alone: openenv cannot be installed beside vLLM 0.32 (see `openenv_countdown.py`).

The environment: reset with the row's `answer` sets the target; `add(a, b)` returns a + b; `submit_answer(answer)`
ends the episode with reward 1.0 when the answer is the target (0.0 otherwise), as openenv's FinQA environment does.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, WebSocket, WebSocketDisconnect

TOOLS = [
    {
        "name": "add",
        "description": "Add two integers.",
        "inputSchema": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
    {
        "name": "submit_answer",
        "description": "Submit the final answer; ends the episode.",
        "inputSchema": {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]},
    },
]


class Arithmetic:
    """One session's environment."""

    def __init__(self) -> None:
        self.target = 0

    def reset(self, answer: Any = 0, **kwargs: Any) -> dict[str, Any]:
        self.target = int(answer)
        return {
            "observation": {"tool_name": None, "result": None, "error": None, "metadata": {}},
            "reward": None,
            "done": False,
        }

    def call_tool(self, tool_name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        reward, done, error, result = None, False, None, None
        if tool_name not in {tool["name"] for tool in TOOLS}:
            error = {"error_type": "tool_not_found", "message": f"Tool '{tool_name}' not found"}
        elif tool_name == "add":
            if set(arguments) != {"a", "b"}:
                error = {"error_type": "invalid_args", "message": f"add takes a and b, got {sorted(arguments)}"}
            else:
                result = _result(arguments["a"] + arguments["b"])
        else:
            correct = int(arguments.get("answer", -1)) == self.target
            reward, done, result = float(correct), True, _result("correct" if correct else "wrong")
        observation = {"tool_name": tool_name, "result": result, "error": error, "metadata": {}}
        return {"observation": observation, "reward": reward, "done": done}


def _result(value: Any) -> dict[str, Any]:
    """fastmcp's `CallToolResult` as openenv serialises it."""
    return {
        "content": [{"type": "text", "text": str(value)}],
        "structured_content": None,
        "meta": None,
        "data": value,
        "is_error": False,
    }


app = FastAPI()


@app.get("/health")
def health() -> dict[str, str]:
    return {"status": "healthy"}


@app.websocket("/ws")
async def session(websocket: WebSocket) -> None:
    await websocket.accept()
    env = Arithmetic()
    try:
        while True:
            message = json.loads(await websocket.receive_text())
            kind, data = message.get("type"), message.get("data") or {}
            if kind == "close":
                break
            if kind == "mcp":
                answer = {"jsonrpc": "2.0", "result": {"tools": TOOLS}, "error": None, "id": data.get("id")}
                await websocket.send_text(json.dumps({"type": "mcp", "data": answer}))
            elif kind == "reset":
                await websocket.send_text(json.dumps({"type": "observation", "data": env.reset(**data)}))
            elif kind == "step" and data.get("type") == "call_tool":
                observation = env.call_tool(data["tool_name"], data.get("arguments") or {})
                await websocket.send_text(json.dumps({"type": "observation", "data": observation}))
            else:
                error = {"message": f"Unknown message type: {kind}", "code": "UNKNOWN_TYPE"}
                await websocket.send_text(json.dumps({"type": "error", "data": error}))
    except WebSocketDisconnect:
        pass
