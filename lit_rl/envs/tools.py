"""Tools the model calls in its turns, and the built-in `ToolEnvironment` that runs them.

The call syntax of the built-in template: a model turn that contains `<name>argument</name>`, with `name` a tool's
function name, calls `name(argument)`; the next observation is `<result>value</result>`. A call that raises or
runs past `timeout_s` is answered with `<result>error: ...</result>` and counted in `tool_errors`. A turn without
a call ends the episode.

Nothing evaluates code by default: the built-in `calc` parses arithmetic (numbers, + - * / // %, unary
minus, parentheses) with `ast` and computes it itself. Each call runs in a daemon thread so a slow one can be timed
out; Python cannot stop a thread, so a tool that ignores its time limit keeps its thread until it returns: a tool
must bound its own work (`calc` refuses long expressions and huge numbers). At most
`lit_rl.envs.runner.MAX_OVERRUNNING` such threads live at once: past that, calls are answered `error: ...` without
running, so they cannot pile up. Episodes' calls run concurrently (`model.env.concurrency`). Finding a call in a
turn takes time linear in its length, whatever tags it leaves open.
"""

from __future__ import annotations

import ast
import bisect
import operator
import re
from typing import Any, Callable, Optional

from lit_rl.envs import runner
from lit_rl.envs.base import StepResult
from lit_rl.envs.runner import EnvCallTimeout, call_in_thread
from lit_rl.errors import ConfigError
from lit_rl.importing import import_callable

Tool = Callable[[str], Any]

_MAX_EXPRESSION = 200  # characters
_MAX_MAGNITUDE = 10**30
_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


def calc(expression: str) -> str:
    """The value of an arithmetic expression (integers and decimals, + - * / // %, unary minus, parentheses), as
    text: an integer when the value is whole. Anything else (names, calls, powers, strings) is a `ValueError`.

    Args:
        expression: the arithmetic expression, for example "1234*5678".
    """
    if len(expression) > _MAX_EXPRESSION:
        raise ValueError(f"expression longer than {_MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    value = _evaluate(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        if not abs(node.value) <= _MAX_MAGNITUDE:
            raise ValueError("number too large")
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        value = _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
        if not abs(value) <= _MAX_MAGNITUDE:  # also NaN (inf - inf)
            raise ValueError("number too large")
        return value
    raise ValueError(f"unsupported element {type(node).__name__} (only numbers and + - * / // %)")


def import_tools(paths: list[str]) -> list[Tool]:
    """The tools at import paths `paths` (`lit_rl.envs.tools.calc`); a one-line error names a bad one."""
    tools = []
    for path in paths:
        try:
            tools.append(import_callable(path, "tool"))
        except ValueError as err:
            raise ConfigError(f"model.env.tools: {err}") from None
    names = [tool.__name__ for tool in tools]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ConfigError(f"model.env.tools: two tools are named {duplicates[0]!r}; names must be unique")
    return tools


def run_tool(tool: Tool, argument: str, timeout_s: float) -> tuple[str, bool]:
    """`tool(argument)` as text, and whether it failed: an exception or a timeout is returned as
    `error: <what happened>` (never raised), so the model sees it as its observation. The call runs on a daemon
    thread (`lit_rl.envs.runner.call_in_thread`): one that never returns cannot keep the process from exiting, and
    while `MAX_OVERRUNNING` calls are still running past their limit a new call is refused the same way instead of
    running."""
    try:
        return str(call_in_thread(tool, (argument,), timeout_s, runner.tool_overrunning)), False
    except EnvCallTimeout as err:
        return f"error: {err}", True
    except Exception as err:  # the tool's own error, shown to the model
        return f"error: {type(err).__name__}: {err}", True


class ToolEnvironment:
    """Runs the first tool call of each model turn (`<name>argument</name>`) and answers `<result>...</result>`;
    a turn without a call ends the episode. No reward parts of its own: the reward functions score the transcript.

    Args:
        tools: the callables (`model.env.tools` import paths), each called with the text between its tags.
        timeout_s: the time limit of one call.
    """

    reward_names: tuple[str, ...] = ()

    def __init__(self, tools: Optional[list[Tool]] = None, timeout_s: float = 5.0) -> None:
        if not tools:
            raise ConfigError("ToolEnvironment needs at least one tool (model.env.tools)")
        if timeout_s <= 0:
            raise ConfigError(f"model.env.environment_args.timeout_s must be > 0, got {timeout_s}")
        self.tools = {tool.__name__: tool for tool in tools}
        self.timeout_s = timeout_s
        names = "|".join(re.escape(name) for name in self.tools)
        self._opening = re.compile(rf"<({names})>")

    def reset(self, row: dict[str, Any]) -> None:
        return None  # the row's prompt is the first observation

    def first_call(self, text: str) -> Optional[tuple[str, str]]:
        """(tool name, argument) of the first `<name>argument</name>` in `text`: the earliest opening tag that a
        closing tag of the same name follows, up to the nearest one (what a lazy regex finds, without its
        quadratic time on many unclosed tags: each closing tag is found once, then looked up by bisection)."""
        closings = {name: [m.start() for m in re.finditer(re.escape(f"</{name}>"), text)] for name in self.tools}
        for opening in self._opening.finditer(text):
            name = opening.group(1)
            after = bisect.bisect_left(closings[name], opening.end())
            if after < len(closings[name]):
                return name, text[opening.end() : closings[name][after]]
        return None

    def step(self, completion: str) -> StepResult:
        call = self.first_call(completion)
        if call is None:
            return StepResult(observation=None, done=True)
        value, failed = run_tool(self.tools[call[0]], call[1], self.timeout_s)
        return StepResult(observation=f"<result>{value}</result>", tool_calls=1, tool_errors=int(failed))
