"""verifiers tasksets' tasks as episodes (`pip install 'lit-rl[verifiers]'`: verifiers 0.4's v1 tasksets):

    data:
      train_data: verifiers:my_tasks?select.limit=2000&select.shuffle=true
    model:
      env:
        environment: lit_rl.envs.Verifiers
        environment_args: {taskset: my_tasks}        # and taskset_args: {...}, if its config needs fields

lit-rl samples; verifiers gives the task and scores it. An episode is one chat turn, as verifiers' plain-chat
harness (`null`) runs a task: the row's prompt (`lit_rl.data.verifiers_tasksets`) is sampled token-in, token-out by
lit-rl's engine like any prompt, and once the episode ends, the reply goes into a verifiers `Trace` (the prompt's
messages and the reply) and the task's own `@vf.reward` functions score it (`Task.score`, awaited on the
environment runner's loop). Each reward is a column `rewards/env/<name>` holding its weighted value
(`score * weight`), so the columns sum to verifiers' `trace.reward`. `@vf.metric` functions are not logged. A
reply that opens with reasoning (`<think>...</think>`, Qwen3's) is split as verifiers' renderer parses a turn: the
rewards score the content after `</think>`, the reasoning goes in the message's `reasoning_content`.

What a one-turn chat episode cannot give is refused when the run starts, in one line, so that no reward is silently
partial: a reward that needs the task's runtime (a sandbox: verifiers itself skips it when there is none), plugged
judges (they call a model), tools (`toolsets`), a task that needs a container or overrides `setup`, `finalize` or
`stage_verifier`, a taskset package exporting its own `Env` or `Harness`. A reward returning a dict of rewards
(or a task scoring other rewards than its functions') fails the episode: lit-rl's columns are fixed when the run
starts. Each task is scored with the task config its taskset's `load()` gave it (carried in its row, and taken only
where this process's `load()` gave it: a row from a file is scored with the taskset's config). Tasksets
written for verifiers' default `bash` harness may expect a shell the model does not have here.
"""

from __future__ import annotations

import functools
import inspect
import json
from typing import Any, Optional

from lit_rl.data.verifiers_tasksets import load_taskset, task_config_loaded
from lit_rl.errors import ConfigError, one_line

WHERE = "model.env.environment_args"
RUNTIME_HOOKS = ("setup", "finalize", "stage_verifier")
BY_HARNESS = "lit_rl.envs.VerifiersHarness runs a task by a harness, in its runtime"
_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"  # a reasoning model's markers (Qwen3's), kept in decoded turns


class Verifiers:
    """One episode of a verifiers task (module docstring): `taskset` is its id (the data spec's), `taskset_args` the
    config fields it needs to be built (its reward functions and the refusals are read from it)."""

    def __init__(self, taskset: str, taskset_args: Optional[dict[str, Any]] = None) -> None:
        loaded = _loaded_taskset(taskset, json.dumps(taskset_args or {}, sort_keys=True))
        self.vf, self.config, self.task_class, self.reward_names = loaded
        self.task: Any = None
        self.prompt: Any = None
        self.reply = ""

    def reset(self, row: dict[str, Any]) -> None:
        self.task, self.prompt = row_task(row, self.config, self.task_class), row["prompt"]
        return None  # the row's prompt, as it is

    def step(self, completion: str) -> tuple[None, dict[str, float], bool]:
        self.reply = completion
        return None, {}, True  # one turn: the plain chat harness's episode

    async def finish(self) -> dict[str, float]:
        """The task's rewards of the episode's reply, each weighted."""
        trace = self._trace()
        await self.task.score(trace, runtime=None)
        scored = {name: reward.value for name, reward in trace.rewards.items() if reward is not None}
        if set(scored) != set(self.reward_names):  # every column, each from the function of its name
            name = type(self.task).__name__
            raise ValueError(
                f"{name} scored rewards {sorted(scored)}, not its reward functions' {list(self.reward_names)}: a "
                "reward returning a dict of rewards (or none) cannot fill a column, and the columns are fixed when "
                "the run starts"
            )
        return scored

    def _trace(self) -> Any:
        """A verifiers Trace of the episode: the prompt's messages and the sampled reply, in one branch."""
        from verifiers.v1.graph import MessageNode
        from verifiers.v1.trace import AgentInfo, TraceTask

        vf, task = self.vf, self.task
        messages = [{"role": "user", "content": self.prompt}] if isinstance(self.prompt, str) else list(self.prompt)
        nodes = [MessageNode(message=message, parent=i - 1 if i else None) for i, message in enumerate(messages)]
        content, reasoning = split_reasoning(self.reply)
        reply = vf.AssistantMessage(content=content, reasoning_content=reasoning)
        nodes.append(MessageNode(message=reply, parent=len(nodes) - 1 if nodes else None, sampled=True))
        recorded = TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash)
        return vf.Trace(task=recorded, agent=AgentInfo(config=vf.AgentConfig()), nodes=nodes)


def split_reasoning(reply: str) -> tuple[str, Optional[str]]:
    """(content, reasoning) of a reply, as verifiers' default renderer parses a turn (`renderers`' `scan_reasoning`):
    the reasoning is a `<think>` block opening the reply (after white space), or what comes before a `</think>` the
    reply never opened (the generation prompt opened it: Qwen3's thinking templates); the content is what follows
    its first `</think>`, white space kept; a block still open is all reasoning, the content empty. A reply without
    one is all content (reasoning None)."""
    opened = reply.lstrip().startswith(_THINK_OPEN)
    start = reply.index(_THINK_OPEN) + len(_THINK_OPEN) if opened else 0
    close = reply.find(_THINK_CLOSE, start)
    if not opened and (close < 0 or _THINK_OPEN in reply[:close]):
        return reply, None
    if close < 0:
        return "", reply[start:] or None
    return reply[close + len(_THINK_CLOSE) :], reply[start:close] or None


def row_task(row: dict[str, Any], taskset_config: Any, task_class: type) -> Any:
    """The verifiers task a row of `lit_rl.data.verifiers_tasksets` holds, rebuilt with the task config its
    taskset's `load()` gave it (what scores it); a one-line error for a row of no task, or of another taskset."""
    entry = row.get("verifiers")
    if not isinstance(entry, dict) or "task" not in entry:
        raise ValueError(
            "the row has no verifiers task (its 'verifiers' column): train on --data.train_data verifiers:<taskset>"
        )
    row_taskset = (entry.get("taskset") or {}).get("id")
    if row_taskset != taskset_config.id:  # its size, seed or other options may differ: validation rows
        raise ValueError(
            f"the row is a task of taskset {row_taskset!r}, {WHERE} gives {taskset_config.id!r}: give "
            "environment_args the data spec's taskset"
        )
    data = task_class.data_type().model_validate(entry["task"])
    given, config = entry.get("task_config"), taskset_config.task
    if given is not None and given != config.model_dump(mode="json"):
        if not task_config_loaded(taskset_config.id, given):
            raise ValueError(
                f"the row's task config is none that taskset {taskset_config.id!r} gave in this run: a row's own task "
                "config could plug judges, reward functions or servers into the task that scores it, so lit-rl takes "
                "it only from rows of a verifiers:<taskset> spec (or a row without one, scored with the taskset's)"
            )
        config = task_class.config_type().model_validate(given)
    return task_class(data, config)


@functools.lru_cache(maxsize=8)
def _loaded_taskset(taskset: str, args_json: str) -> tuple[Any, Any, type, tuple[str, ...]]:
    """(verifiers.v1, the taskset's config, its Task class, its reward names), checked once per run: what a one-turn
    chat episode cannot give is refused (module docstring)."""
    args = json.loads(args_json)
    vf, config, loaded = load_taskset(taskset, args, lambda message: ConfigError(f"{WHERE}: {message}"))

    task_class = loaded.task_type()

    def refuse(reason: str) -> ConfigError:
        return ConfigError(f"{WHERE}: taskset {taskset!r}: {reason}; lit-rl runs a task as one chat turn")

    try:
        reward_names = _one_turn_rewards(vf, config, loaded, task_class, refuse)
    except ConfigError:
        raise
    except Exception as err:  # the taskset's own code (toolsets, its exports, its task's constructor)
        raise ConfigError(f"{WHERE}: taskset {taskset!r}: {type(err).__name__}: {one_line(err)}") from None
    return vf, config, task_class, reward_names


def _one_turn_rewards(vf: Any, config: Any, loaded: Any, task_class: type, refuse: Any) -> tuple[str, ...]:
    """The reward names of a taskset whose tasks one chat turn can score; `refuse(reason)` otherwise."""
    from verifiers.v1.utils.loaders import default_harness_id, environment_class

    taskset, name = config.id, task_class.__name__

    if environment_class(taskset) is not vf.SingleAgentEnv:
        raise refuse("its package exports its own Env")
    if default_harness_id(taskset) != "bash":
        raise refuse(f"its package exports its own Harness ({BY_HARNESS})")
    if getattr(task_class, "NEEDS_CONTAINER", False):
        raise refuse(f"{name} needs a container (NEEDS_CONTAINER)")
    for hook in RUNTIME_HOOKS:
        if getattr(task_class, hook) is not getattr(vf.Task, hook):
            raise refuse(f"{name} overrides {hook}, which runs in the task's runtime ({BY_HARNESS})")
    if type(loaded).toolsets(config) or task_class.toolsets(config.task):
        raise refuse("its tasks call tools (toolsets)")
    if config.task.judges:
        raise refuse("its task config plugs judges, which call a model")
    probe = task_class(task_class.data_type().model_construct(), config.task)
    rewards = probe.hooks("reward")
    for function in rewards:
        runtime = inspect.signature(function).parameters.get("runtime")
        if runtime is not None and runtime.default is inspect.Parameter.empty:
            raise refuse(f"{name}'s reward {function.__name__} needs the task's runtime, a sandbox ({BY_HARNESS})")
    if not rewards:
        raise refuse(f"{name} has no @vf.reward function")
    return tuple(function.__name__ for function in rewards)
