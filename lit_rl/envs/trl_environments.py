"""TRL's environment classes (`GRPOTrainer(environment_factory=...)`), run unchanged by `--model.env.environment`.

TRL's contract, which `TRLEnvironment` keeps:

- A class with a callable `reset` is TRL's kind when it has no `step`, or when its `reset` takes the row's columns
  as keywords (`**kwargs`) and nothing positionally (a `step` is then one of its tools: a move in a game); lit-rl's
  own protocol has both, and its `reset(row)` takes the row positionally. One instance runs one episode.
- `reset(**row)` gets every column of the episode's row as keywords (the dataset's task data) and returns None or
  text; text is appended to the prompt's last user message (to the prompt, for a text prompt).
- Every other public function of the class is a tool (`tool_methods`: a staticmethod too; a property is never read),
  called in the model's chat format (`lit_rl.envs.chat_tools`): its schema comes from its type hints and docstring
  and goes into the prompt; sync or `async def`.
- An optional `get_reward()` (sync or `async def`) scores the episode from the environment's state, once, when the
  episode ends: a reward column named after the class (`rewards/env/<ClassName>`), weight 1, as in TRL. None is an
  invalid reward (NaN, as TRL makes it), counted as a reward function's None is (`model.rewards.on_invalid`).
- Reward functions receive the episodes' instances as `environments=` (one per completion).
- Several classes by name (TRL's `environment_factory={name: factory}`; here `model.env.environment: {name: import
  path}`): each row's `environment` column picks its episode's class (`EnvironmentRouting`), only that class's
  methods (and the standalone tools) reach its prompt, and `environment` is not passed to `reset`. Each class with a
  `get_reward` has its column; an episode of another class counts 0 in it (TRL: None, left out of the column's mean).

Standalone `model.env.tools` are offered beside the methods, as TRL's `tools=` are. The tool calls of a step run
on the step's thread, bounded by `model.env.step_timeout_s` (a step past it ends its episode, counted in
`env_timeouts`, and that episode's `get_reward` is not called: its environment is still busy).
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

from lit_rl.envs.base import UserObjectAdapter
from lit_rl.envs.chat_tools import HERMES, ChatToolEnvironment, TemplateCalls
from lit_rl.errors import DataError

RESERVED = ("reset", "get_reward")
ROUTING_COLUMN = "environment"  # TRL's: the column of a row that names its environment


def is_trl_environment(cls: Any) -> bool:
    """Whether `cls` is a TRL environment class (module docstring): a callable `reset`, and no `step` or a `reset`
    that takes the row as keywords alone, as TRL calls it (`reset(**row)`; lit-rl calls its own `reset(row)`)."""
    if not callable(getattr(cls, "reset", None)):
        return False
    return not hasattr(cls, "step") or _resets_from_keywords(cls)


def _resets_from_keywords(cls: Any) -> bool:
    """Whether `cls.reset` has a `**kwargs` and no required positional parameter but `self`: it can be called
    `reset(**row)`, never `reset(row)`."""
    reset = getattr(cls, "reset")
    try:
        parameters = list(inspect.signature(reset).parameters.values())
    except (TypeError, ValueError):  # no signature to read (a builtin's): not a Python class's `reset(**row)`
        return False
    if isinstance(cls, type) and inspect.isfunction(reset) and not _is_static(cls, "reset"):
        parameters = parameters[1:]  # `self`, not bound on the class
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p for p in parameters if p.kind in positional and p.default is inspect.Parameter.empty]
    return not required and any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def _is_static(cls: type, name: str) -> bool:
    """Whether `cls`'s attribute `name` is a staticmethod (its function takes no `self`)."""
    return isinstance(inspect.getattr_static(cls, name, None), staticmethod)


def tool_methods(instance: Any) -> list[Callable[..., Any]]:
    """The tools of a TRL environment `instance`, as TRL finds them: the functions of its class (staticmethods among
    them; read on the class, so no property is evaluated, as TRL's trainer avoids) whose names are public and neither
    `reset` nor `get_reward`, each as the instance gives it (a bound method, or a staticmethod's function)."""
    return [
        getattr(instance, name)
        for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
        if name not in RESERVED and not name.startswith("_")
    ]


def _resolved(value: Any) -> Any:
    """`value`, awaited on this (worker) thread's own event loop when a method returned a coroutine."""
    return asyncio.run(value) if inspect.iscoroutine(value) else value


def _appended(prompt: Any, text: str) -> Any:
    """`prompt` with `text` appended to its last message (a chat prompt, as TRL does) or to itself (a text one)."""
    if isinstance(prompt, str):
        return prompt + text
    messages = [dict(message) for message in prompt]
    messages[-1]["content"] = str(messages[-1].get("content") or "") + text
    return messages


class TRLEnvironment(ChatToolEnvironment, UserObjectAdapter):
    """One episode of a TRL environment `instance` (module docstring), with the standalone `tools` beside its
    methods.

    Args:
        instance: a fresh instance of the user's class.
        tools: `model.env.tools` (functions), offered beside the instance's methods.
    """

    # TRL runs no tool call whose result the model would never see: the last turn's calls are not made, so
    # `get_reward` and `environments=` see the state the model acted on.
    steps_after_last_turn = False

    def __init__(
        self,
        instance: Any,
        tools: Optional[list[Callable[..., Any]]] = None,
        call_format: str = HERMES,
        template_calls: Optional[TemplateCalls] = None,
        routed: bool = False,
    ) -> None:
        methods = tool_methods(instance)
        if not methods and not tools:
            raise TypeError(
                f"{type(instance).__name__} has no public method to offer as a tool (TRL's environments expose "
                "theirs; give one, or model.env.tools)"
            )
        # Calls bounded by the step's own time limit, written in the model's template's format.
        super().__init__(
            [*(tools or []), *methods], timeout_s=None, call_format=call_format, template_calls=template_calls
        )
        self.instance = instance
        self.routed = routed  # picked by the row's `environment` column, which TRL does not pass to `reset`
        self.owns_reward = callable(getattr(instance, "get_reward", None))
        self.reward_names = (type(instance).__name__,) if self.owns_reward else ()

    def reset(self, row: dict[str, Any]) -> Any:
        """The episode's prompt: the row's, with what the instance's `reset(**row)` returned appended (TRL's
        rule); None (the row's prompt as it is) when it returned None."""
        row = {key: value for key, value in row.items() if not (self.routed and key == ROUTING_COLUMN)}
        observation = _resolved(self.instance.reset(**copy.deepcopy(row)))  # the G episodes of a row share it
        if observation is None:
            return None
        return _appended(row["prompt"], str(observation))

    def finish(self) -> dict[str, float]:
        """The episode's reward from the instance's `get_reward()`, called once when the episode has ended. None
        (TRL: NaN) is NaN, an invalid reward, as a reward function's None is (`model.rewards.on_invalid`)."""
        if not self.owns_reward:
            return {}
        value = _resolved(self.instance.get_reward())
        return {self.reward_names[0]: math.nan if value is None else float(value)}


@dataclass(frozen=True)
class EnvironmentRouting:
    """TRL's dict of environments: each row's `environment` column names the class its episodes run in, and its
    prompt is rendered with that class's tools alone.

    A tool's result is rendered after a turn with every environment's schemas (`EnvironmentSpec.tool_schemas`): the
    templates that take tools write them before the first turn, never after one, so the render is the same.

    Args:
        tools: the tools' JSON schemas of each environment, by name (the standalone tools, then its methods).
    """

    tools: dict[str, list[dict[str, Any]]]

    def name_of(self, row: dict[str, Any]) -> str:
        """The environment `row` names; a one-line error when it names none of them."""
        name = row.get(ROUTING_COLUMN)
        if not self.names_one(name):
            raise DataError(f"the row {self.unknown(name)}")
        return name

    def names_one(self, name: Any) -> bool:
        """Whether an `environment` column's value `name` is one of the environments' names."""
        return isinstance(name, str) and name in self.tools

    def unknown(self, name: Any) -> str:
        """Why a row whose `environment` column holds `name` cannot run, to follow the row's name."""
        what = "has no environment column" if name is None else f"has environment {name!r}"
        return (
            f"{what}, which must name one of model.env.environment's: {', '.join(self.tools)} "
            "(with several environments, each row picks its own, as in TRL)"
        )

    def check(self, rows: list[dict[str, Any]]) -> Optional[str]:
        """Why the first of `rows` that names no environment cannot run; None when every row names one."""
        for row in rows:
            if not self.names_one(row.get(ROUTING_COLUMN)):
                return f"the row {self.unknown(row.get(ROUTING_COLUMN))}"
        return None

    def prompt_tools(self, rows: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
        """Each row's prompt's tool schemas: its environment's."""
        return [self.tools[self.name_of(row)] for row in rows]
