"""verifiers tasksets' tasks as episodes (`pip install 'lit-rl[verifiers]'`: verifiers 0.4's v1 tasksets):

    data:
      train_data: verifiers:my_tasks?limit=2000&shuffle=true
    model:
      env:
        environment: lit_rl.envs.Verifiers
        environment_args: {taskset: my_tasks}        # and taskset_args: {...}, the data spec's config fields

lit-rl samples; verifiers gives the task and scores it. An episode is one chat turn, as verifiers' plain-chat
harness (`null`) runs a task: the row's prompt (`lit_rl.data.verifiers_tasksets`) is sampled token-in, token-out by
lit-rl's engine like any prompt, and once the episode ends, the reply goes into a verifiers `Trace` (the prompt's
messages and the reply) and the task's own `@vf.reward` functions score it (`Task.score`, awaited on the
environment runner's loop). Each reward is a column `rewards/env/<name>` holding its weighted value
(`score * weight`), so the columns sum to verifiers' `trace.reward`. `@vf.metric` functions are not logged.

What a one-turn chat episode cannot give is refused when the run starts, in one line, so that no reward is silently
partial: a reward that needs the task's runtime (a sandbox: verifiers itself skips it when there is none), plugged
judges (they call a model), tools (`toolsets`), a task that needs a container or overrides `setup`, `finalize` or
`stage_verifier`, a taskset package exporting its own `Env` or `Harness`. A reward returning a dict of rewards
fails the episode (lit-rl's columns are fixed when the run starts). Tasksets written for verifiers' default `bash`
harness may expect a shell the model does not have here.
"""

from __future__ import annotations

import functools
import inspect
import json
from typing import Any, Optional

from lit_rl.data.verifiers_tasksets import load_taskset
from lit_rl.errors import ConfigError

WHERE = "model.env.environment_args"
RUNTIME_HOOKS = ("setup", "finalize", "stage_verifier")
SCORING_CONFIG = ("id", "task")  # what of a taskset's config the scoring of its tasks depends on


class Verifiers:
    """One episode of a verifiers task (module docstring): `taskset` is its id, `taskset_args` its config fields,
    the same as the data spec's."""

    def __init__(self, taskset: str, taskset_args: Optional[dict[str, Any]] = None) -> None:
        loaded = _loaded_taskset(taskset, json.dumps(taskset_args or {}, sort_keys=True))
        self.vf, self.config, self.task_class, self.reward_names = loaded
        self.taskset_config = self.config.model_dump(mode="json")
        self.task: Any = None
        self.prompt: Any = None
        self.reply = ""

    def reset(self, row: dict[str, Any]) -> None:
        entry = row.get("verifiers")
        if not isinstance(entry, dict) or "task" not in entry:
            raise ValueError(
                "the row has no verifiers task (its 'verifiers' column): train on --data.train_data verifiers:<taskset>"
            )
        row_config = entry.get("taskset") or {}
        for key in SCORING_CONFIG:  # the taskset and the tasks' config; its size, seed or split may differ
            if row_config.get(key) != self.taskset_config[key]:
                raise ValueError(
                    f"the row's taskset config has {key} {row_config.get(key)!r}, {WHERE} gives "
                    f"{self.taskset_config[key]!r}: give environment_args the data spec's taskset and task config"
                )
        data = self.task_class.data_type().model_validate(entry["task"])
        self.task, self.prompt = self.task_class(data, self.config.task), row["prompt"]
        return None  # the row's prompt, as it is

    def step(self, completion: str) -> tuple[None, dict[str, float], bool]:
        self.reply = completion
        return None, {}, True  # one turn: the plain chat harness's episode

    async def finish(self) -> dict[str, float]:
        """The task's rewards of the episode's reply, each weighted."""
        trace = self._trace()
        await self.task.score(trace, runtime=None)
        parts = {}
        for name, reward in trace.rewards.items():
            if name not in self.reward_names:
                raise ValueError(
                    f"{type(self.task).__name__} gave reward {name!r}, not one of its reward functions' names "
                    f"({', '.join(self.reward_names)}): a reward returning a dict of rewards cannot be a column, "
                    "which are fixed when the run starts"
                )
            if reward is None:
                raise ValueError(f"{type(self.task).__name__}'s reward {name!r} was not scored")
            parts[name] = reward.value
        return parts

    def _trace(self) -> Any:
        """A verifiers Trace of the episode: the prompt's messages and the sampled reply, in one branch."""
        from verifiers.v1.graph import MessageNode
        from verifiers.v1.trace import AgentInfo, TraceTask

        vf, task = self.vf, self.task
        messages = [{"role": "user", "content": self.prompt}] if isinstance(self.prompt, str) else list(self.prompt)
        nodes = [MessageNode(message=message, parent=i - 1 if i else None) for i, message in enumerate(messages)]
        reply = vf.AssistantMessage(content=self.reply)
        nodes.append(MessageNode(message=reply, parent=len(nodes) - 1 if nodes else None, sampled=True))
        recorded = TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash)
        return vf.Trace(task=recorded, agent=AgentInfo(config=vf.AgentConfig()), nodes=nodes)


@functools.lru_cache(maxsize=8)
def _loaded_taskset(taskset: str, args_json: str) -> tuple[Any, Any, type, tuple[str, ...]]:
    """(verifiers.v1, the taskset's config, its Task class, its reward names), checked once per run: what a one-turn
    chat episode cannot give is refused (module docstring)."""
    args = json.loads(args_json)
    vf, config, loaded = load_taskset(taskset, args, lambda message: ConfigError(f"{WHERE}: {message}"))
    from verifiers.v1.utils.loaders import default_harness_id, environment_class

    task_class = loaded.task_type()
    name = task_class.__name__

    def refuse(reason: str) -> ConfigError:
        return ConfigError(f"{WHERE}: taskset {taskset!r}: {reason}; lit-rl runs a task as one chat turn")

    if environment_class(taskset) is not vf.SingleAgentEnv:
        raise refuse("its package exports its own Env")
    if default_harness_id(taskset) != "bash":
        raise refuse("its package exports its own Harness")
    if getattr(task_class, "NEEDS_CONTAINER", False):
        raise refuse(f"{name} needs a container (NEEDS_CONTAINER)")
    for hook in RUNTIME_HOOKS:
        if getattr(task_class, hook) is not getattr(vf.Task, hook):
            raise refuse(f"{name} overrides {hook}, which runs in the task's runtime")
    if type(loaded).toolsets(config) or task_class.toolsets(config.task):
        raise refuse("its tasks call tools (toolsets)")
    if config.task.judges:
        raise refuse("its task config plugs judges, which call a model")
    probe = task_class(task_class.data_type().model_construct(), config.task)
    rewards = probe.hooks("reward")
    for function in rewards:
        runtime = inspect.signature(function).parameters.get("runtime")
        if runtime is not None and runtime.default is inspect.Parameter.empty:
            raise refuse(f"{name}'s reward {function.__name__} needs the task's runtime (a sandbox)")
    if not rewards:
        raise refuse(f"{name} has no @vf.reward function")
    return vf, config, task_class, tuple(function.__name__ for function in rewards)
