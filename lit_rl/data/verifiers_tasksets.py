"""verifiers tasksets as data (`pip install 'lit-rl[verifiers]'`: verifiers 0.4, its v1 tasksets), offline:

    --data.train_data 'verifiers:my_tasks'
    --data.train_data 'verifiers:my_tasks?select.limit=2000&select.shuffle=true&select.seed=0'
    --data.train_data 'verifiers:my_tasks?size=256&seed=1&prompt=text'

`my_tasks` is a taskset id as verifiers' `vf-eval` takes it (`owner/name@version` is the module `name`): a module
(installed, or a `my_tasks.py` or `my_tasks/` beside the run) whose `__all__` exports one `vf.Taskset` subclass.
After `?` come verifiers' selection under `select.` (`select.limit`, `select.skip`, `select.shuffle`,
`select.seed`: its `SelectConfig`, applied in its order, as `--select.*` in verifiers' commands), the taskset's own
config fields (its `TasksetConfig`: `size=256&seed=1` above; a value is read as JSON where it parses) and lit-rl's
`prompt=chat` (the default: the task's system prompt and prompt as chat messages, as verifiers' plain-chat harness
sends them) or `prompt=text` (the two as one text, for a base model). Each row holds `prompt` and `verifiers`: the
taskset's config, the task's data and its task config, from which `lit_rl.envs.Verifiers` rebuilds the task and
scores the episode with the task's own rewards.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from lit_rl.data.spec_options import query_options
from lit_rl.errors import DataError, one_line

PREFIX = "verifiers:"
SELECT = "select."
SELECT_OPTIONS = ("limit", "skip", "shuffle", "seed")
PROMPT_STYLES = ("chat", "text")
INSTALL = "pip install 'lit-rl[verifiers]'"


# The task configs the tasksets' `load()` gave in this process, by taskset id (as canonical JSON): a row's own task
# config is taken only where it is one of them (`lit_rl.envs.verifiers_tasks.row_task`). A row from a data file is
# anyone's, and its config could plug judges (a model called with a key from the environment), reward functions
# from a file, or a server of its choosing into the task that scores it.
_LOADED_TASK_CONFIGS: dict[str, set[str]] = {}


def _canonical(task_config: dict[str, Any]) -> str:
    return json.dumps(task_config, sort_keys=True)


def task_config_loaded(taskset_id: str, task_config: dict[str, Any]) -> bool:
    """Whether `task_config` (as a row holds it) is one that taskset `taskset_id`'s `load()` gave in this process."""
    return _canonical(task_config) in _LOADED_TASK_CONFIGS.get(taskset_id, ())


def is_verifiers(spec: str) -> bool:
    return spec.startswith(PREFIX)


def parse_spec(spec: str) -> tuple[str, dict[str, Any], dict[str, Any], str]:
    """`verifiers:<taskset>[?<option>=<value>&...]` -> (taskset id, selection, taskset config fields, prompt style);
    a one-line `DataError` naming the spec when it cannot be read."""
    taskset, _, query = spec[len(PREFIX) :].partition("?")
    taskset = taskset.strip()
    if not taskset:
        raise DataError(f"{spec!r}: name a verifiers taskset module after 'verifiers:' (e.g. verifiers:my_tasks)")
    options = query_options(spec, query)
    style = options.pop("prompt", "chat")
    if style not in PROMPT_STYLES:
        raise DataError(f"{spec!r}: prompt must be one of {', '.join(PROMPT_STYLES)}, got {style!r}")
    select = {key[len(SELECT) :]: options.pop(key) for key in list(options) if key.startswith(SELECT)}
    unknown = sorted(set(select) - set(SELECT_OPTIONS))
    if unknown:
        raise DataError(f"{spec!r}: select.{unknown[0]} is not one of {', '.join(SELECT + o for o in SELECT_OPTIONS)}")
    if "seed" in select and select.get("shuffle") is not True:  # verifiers reads it only to shuffle
        raise DataError(f"{spec!r}: select.seed orders a shuffle: add select.shuffle=true (a taskset's seed is seed=)")
    return taskset, select, options, style


def module_name(taskset: str) -> str:
    """The module a taskset id names, as verifiers finds it: `owner/name@version` -> `name`, `-` -> `_`."""
    return taskset.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()


def load_taskset(taskset: str, args: dict[str, Any], fail: Callable[[str], Exception]) -> tuple[Any, Any, Any]:
    """(verifiers.v1, the taskset's config, the taskset) of taskset id `taskset` with config fields `args`; `fail`
    makes the one-line error (naming where the setting is) when verifiers, the module or its config is wrong."""
    try:
        import verifiers.v1 as vf
    except ImportError as err:
        raise fail(f"verifiers does not import ({err}): {INSTALL}") from None
    import importlib.util

    from lit_rl.importing import import_module

    name = module_name(taskset)
    # lit-rl's import, so that a taskset module beside the run is found too (verifiers imports by name), unless
    # verifiers has a taskset of that name itself, which it then loads.
    if importlib.util.find_spec(f"verifiers.v1.tasksets.{name}") is None:
        try:
            import_module(name)
        except Exception as err:
            raise fail(f"cannot import taskset module {name!r} ({type(err).__name__}: {one_line(err)})") from None
    try:
        config = vf.taskset_config_type(taskset).model_validate({**args, "id": taskset})
        return vf, config, vf.load_taskset(config)
    except Exception as err:  # no Taskset in __all__, an unknown or ill-typed config field: verifiers' message
        raise fail(f"taskset {taskset!r}: {type(err).__name__}: {one_line(err)}") from None


def task_prompt(data: Any, style: str, where: str) -> Any:
    """A task's prompt in lit-rl's row format: chat messages (`chat`: its system prompt first, as verifiers' plain
    chat harness sends it) or one text (`text`)."""
    if getattr(data, "image", None) is not None:
        raise DataError(f"{where} has an image: lit-rl trains verifiers' text tasks only")
    prompt = data.prompt
    if not prompt:
        raise DataError(f"{where} has no prompt")
    if style == "text":
        if not isinstance(prompt, str):
            raise DataError(f"{where}: prompt=text needs a prompt that is text, not chat messages (use prompt=chat)")
        return f"{data.system_prompt}\n\n{prompt}" if data.system_prompt else prompt
    messages = (
        [{"role": "user", "content": prompt}]
        if isinstance(prompt, str)
        else [message.model_dump(mode="json", exclude_none=True) for message in prompt]
    )
    return ([{"role": "system", "content": data.system_prompt}] if data.system_prompt else []) + messages


def load_verifiers_rows(spec: str) -> list[dict[str, Any]]:
    """The rows of `spec` (module docstring)."""
    taskset_id, select, args, style = parse_spec(spec)
    vf, config, taskset = load_taskset(taskset_id, args, lambda message: DataError(f"{spec!r}: {message}"))
    try:
        view = taskset.select(vf.SelectConfig.model_validate(select))
        if not view.bounded:
            raise ValueError(f"{type(taskset).__name__} is infinite: give select.limit=N")
        tasks = list(view)
    except Exception as err:
        raise DataError(f"{spec!r}: {type(err).__name__}: {one_line(err)}") from None
    taskset_config = config.model_dump(mode="json")
    rows = [
        {
            "prompt": task_prompt(task.data, style, f"{spec!r}: task {index}"),
            "verifiers": {
                "taskset": taskset_config,
                "task": task.data.model_dump(mode="json"),
                "task_config": task.config.model_dump(mode="json"),  # as load() made it: what scores the task
            },
        }
        for index, task in enumerate(tasks)
    ]
    loaded = _LOADED_TASK_CONFIGS.setdefault(config.id, set())
    loaded.update(_canonical(row["verifiers"]["task_config"]) for row in rows)
    return rows
