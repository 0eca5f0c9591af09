"""The `Environment` protocol: what a multi-turn rollout asks of the world the model acts in.

One environment object runs one episode (one completion of one prompt row):

    first = env.reset(row)                  # the first observation: text, chat messages, or None (the row's prompt)
    result = env.step(model_turn_text)      # after each model turn: StepResult(observation, rewards, done)

`step` may return a `StepResult` or the plain tuple `(observation or None, {reward part: value}, done)`. The
episode ends when `done` is true, when `observation` is None, after `max_turns` model turns, or when the transcript
reaches `max_total_tokens`. Its reward is the sum of the reward parts over its steps (each part a column of its
own, named in the class attribute `reward_names`, weight 1) plus the reward functions applied to the final
transcript.

Environments run in the trainer's process, on every rank, for that rank's episodes: they must not block for long
(a tool call has a time limit, `lit_rl.envs.tools`) and must not run code from the model unless the user asked for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Union

from lit_rl.errors import ConfigError
from lit_rl.importing import import_callable

Observation = Union[str, list[dict[str, Any]]]


@dataclass
class StepResult:
    """What one `step` returns: the next observation (None: the episode ends), reward parts, whether it is done,
    and the tool calls it ran and how many of them failed (an exception or a timeout). An observation is text
    (encoded as is) or chat messages (`[{"role": "tool", "content": ...}]`, rendered by the tokenizer's chat template:
    `lit_rl.envs.chat_tools.ChatRenderer`)."""

    observation: Optional[Observation]
    rewards: dict[str, float] = field(default_factory=dict)
    done: bool = False
    tool_calls: int = 0
    tool_errors: int = 0


class Environment(Protocol):
    """One episode's environment (see the module docstring)."""

    reward_names: tuple[str, ...]

    def reset(self, row: dict[str, Any]) -> Optional[Observation]: ...

    def step(self, completion: str) -> StepResult | tuple[Optional[str], dict[str, float], bool]: ...


def as_step_result(value: Any, where: str) -> StepResult:
    """`step`'s return value as a StepResult; a clear error naming the environment (`where`) otherwise."""
    if isinstance(value, StepResult):
        return value
    if isinstance(value, tuple) and len(value) == 3:
        observation, rewards, done = value
        return StepResult(observation, dict(rewards or {}), bool(done))
    raise TypeError(f"{where}.step must return a StepResult or (observation, rewards, done), got {value!r}")


def environment_factory(
    path: Optional[str], args: Optional[dict[str, Any]], tools: Optional[list[str]], chat_tools: bool = False
) -> tuple[Optional[Callable[[], Environment]], tuple[str, ...]]:
    """A function that makes one environment per episode, and the reward part names its episodes report, from the
    settings `model.env.environment` (an import path), `model.env.environment_args` and `model.env.tools`; (None, ())
    when there is no environment. Tools alone give the built-in `ToolEnvironment`, or with `chat_tools` (calls in
    the chat template's format) `ChatToolEnvironment`; with an environment they are passed to it as `tools=`."""
    from lit_rl.envs.chat_tools import ChatToolEnvironment
    from lit_rl.envs.tools import ToolEnvironment, import_tools

    if path is None and not tools:
        if args:
            raise ConfigError("model.env.environment_args is set but model.env.environment is not")
        return None, ()
    if path is None:
        cls: Callable[..., Environment] = ChatToolEnvironment if chat_tools else ToolEnvironment
    else:
        try:
            cls = import_callable(path, "environment")
        except ValueError as err:
            raise ConfigError(f"model.env.environment: {err}") from None
    kwargs = dict(args or {})
    if tools:
        kwargs["tools"] = import_tools(tools)
    try:
        probe = cls(**kwargs)  # checks the arguments now, before any rollout
    except TypeError as err:
        raise ConfigError(f"model.env.environment {path or cls.__name__}: {err}") from None
    names = tuple(getattr(probe, "reward_names", ()))
    return (lambda: cls(**kwargs)), names
