"""TRL's environment classes (`GRPOTrainer(environment_factory=...)`), run unchanged by `--model.env.environment`.

TRL's contract, which `TRLEnvironment` keeps:

- A class with a callable `reset` and no `step` is TRL's kind. One instance runs one episode.
- `reset(**row)` gets every column of the episode's row as keywords (the dataset's task data) and returns None or
  text; text is appended to the prompt's last user message (to the prompt, for a text prompt).
- Every other public method is a tool, called in the model's chat format (`lit_rl.envs.chat_tools`): its schema comes
  from its type hints and docstring and goes into the prompt; sync or `async def`.
- An optional `get_reward()` (sync or `async def`) scores the episode from the environment's state, once, when the
  episode ends: a reward column named after the class (`rewards/env/<ClassName>`), weight 1, as in TRL.
- Reward functions receive the episodes' instances as `environments=` (one per completion).

Standalone `model.env.tools` are offered beside the methods, as TRL's `tools=` are. The tool calls of a step run
on the step's thread, bounded by `model.env.step_timeout_s` (a step past it ends its episode, counted in
`env_timeouts`, and that episode's `get_reward` is not called: its environment is still busy).
"""

from __future__ import annotations

import asyncio
import copy
import inspect
from typing import Any, Callable, Optional

from lit_rl.envs.chat_tools import HERMES, ChatToolEnvironment, TemplateCalls

RESERVED = ("reset", "get_reward")


def is_trl_environment(cls: Any) -> bool:
    """Whether `cls` is a TRL environment class: a callable `reset` and no `step` (lit-rl's own protocol has both)."""
    return callable(getattr(cls, "reset", None)) and not hasattr(cls, "step")


def tool_methods(instance: Any) -> list[Callable[..., Any]]:
    """The public methods of a TRL environment `instance` but `reset` and `get_reward`: its tools, as TRL finds them."""
    return [
        member
        for name, member in inspect.getmembers(instance, predicate=inspect.ismethod)
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


class TRLEnvironment(ChatToolEnvironment):
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
        self.owns_reward = callable(getattr(instance, "get_reward", None))
        self.reward_names = (type(instance).__name__,) if self.owns_reward else ()

    def reset(self, row: dict[str, Any]) -> Any:
        """The episode's prompt: the row's, with what the instance's `reset(**row)` returned appended (TRL's
        rule); None (the row's prompt as it is) when it returned None."""
        observation = _resolved(self.instance.reset(**copy.deepcopy(row)))  # the G episodes of a row share it
        if observation is None:
            return None
        return _appended(row["prompt"], str(observation))

    def finish(self) -> dict[str, float]:
        """The episode's reward from the instance's `get_reward()`, called once when the episode has ended."""
        if not self.owns_reward:
            return {}
        return {self.reward_names[0]: float(_resolved(self.instance.get_reward()))}
