"""reasoning-gym's procedural tasks as data (`pip install 'lit-rl[reasoning-gym]'`), offline:

    --data.train_data 'reasoning_gym:basic_arithmetic?size=2000&seed=1'
    --data.train_data 'reasoning_gym:basic_arithmetic?size=2000&seed=1&min_terms=2&max_terms=3'
    --data.train_data 'reasoning_gym:basic_arithmetic,leg_counting?size=2000&seed=1'     # a mix, equal weights

After `?` come the task's own options (`reasoning_gym.create_dataset(name, **options)`: `size`, `seed` and the task's
config fields; a value is read as JSON where it parses, `3`, `true`, `["+", "-"]`, and as text otherwise), and one of
lit-rl's: `prompt=text` (the default: the question as it is, for a base model) or `prompt=chat` (reasoning-gym's
default system prompt, which asks for the answer in `<answer>` tags, and the question as a user message). Several
tasks, comma-separated, make reasoning-gym's `composite` dataset with equal weights (then only `size`, `seed` and
`prompt` may be given). Each row holds `prompt`, `answer`, `reasoning_gym` (the task's entry: question, answer and
metadata), which `lit_rl.rewards.reasoning_gym.score` scores with the task's own scorer built with the spec's task
options (`reasoning_gym_options`), and `completion` (the answer as the prompt style asks for it:
`<answer>...</answer>` for `chat`), so SFT trains on the same spec.
"""

from __future__ import annotations

import functools
import inspect
import json
import re
from typing import Any, Callable, Optional

from lit_rl.data.spec_options import query_options
from lit_rl.errors import DataError, one_line

PREFIX = "reasoning_gym:"
PROMPT_STYLES = ("text", "chat")
MIX_OPTIONS = ("size", "seed")
TRUST_OPTION = "trust_scorer"
# What runs text as code: Python's own, and sympy's parsers (which eval, and can hang on `9**9**9`).
EVALUATING = re.compile(r"\b(eval|exec|compile|parse_expr|sympify|parse_latex)\(")


# The tasks whose scorers run text as code that a spec of this process trusted (`trust_scorer=true`): the reward
# (`lit_rl.rewards.reasoning_gym.score`) runs no other such scorer, whatever rows name them (a data file's rows
# choose their task by name, and would otherwise choose an `eval` of their own answer or of the model's).
_TRUSTED_SCORERS: set[str] = set()


# The task options of every single-task spec loaded in this process, as (task, canonical JSON): the reward builds a
# task's scorer with the options a row's `reasoning_gym_options` names only when a spec registered them (a row from
# a file would otherwise choose the dataset config its scorer is built with).
_SCORING_OPTIONS: set[tuple[str, str]] = set()
OPTIONS_COLUMN = "reasoning_gym_options"


def options_key(options: dict[str, Any]) -> str:
    """Task options as one canonical string (a cache key, and what `_SCORING_OPTIONS` holds)."""
    return json.dumps(options, sort_keys=True)


def scoring_options_registered(task: str, options: dict[str, Any]) -> bool:
    """Whether a spec loaded in this process made `task`'s rows with `options`."""
    return (task, options_key(options)) in _SCORING_OPTIONS


def scorer_trusted(task: str) -> bool:
    """Whether a `reasoning_gym:` spec loaded in this process said `trust_scorer=true` for `task`."""
    return task in _TRUSTED_SCORERS


def is_reasoning_gym(spec: str) -> bool:
    return spec.startswith(PREFIX)


def parse_spec(spec: str) -> tuple[list[str], dict[str, Any], str]:
    """`reasoning_gym:<task>[,<task>...][?<option>=<value>&...]` -> (tasks, the tasks' options, prompt style); a
    one-line `DataError` naming the spec when it cannot be read."""
    body, _, query = spec[len(PREFIX) :].partition("?")
    tasks = [task.strip() for task in body.split(",")]
    if not all(tasks):
        raise DataError(f"{spec!r}: name a reasoning-gym task after 'reasoning_gym:' (e.g. basic_arithmetic)")
    options = query_options(spec, query)
    if "seed" not in options:  # reasoning-gym would draw one: each rank and each resume would get other rows
        raise DataError(f"{spec!r}: give a seed (seed=N), so that every rank and every resume makes the same rows")
    style = options.pop("prompt", "text")
    if style not in PROMPT_STYLES:
        raise DataError(f"{spec!r}: prompt must be one of {', '.join(PROMPT_STYLES)}, got {style!r}")
    if len(tasks) > 1:
        others = sorted(set(options) - set(MIX_OPTIONS) - {TRUST_OPTION})
        if others:
            raise DataError(f"{spec!r}: a mix of tasks takes only size and seed, not {others[0]!r}")
    return tasks, options, style


def load_reasoning_gym_rows(spec: str) -> list[dict[str, Any]]:
    """The rows of `spec` (module docstring)."""
    tasks, options, style = parse_spec(spec)
    trusted = options.pop(TRUST_OPTION, False) is True
    try:
        import reasoning_gym
        from reasoning_gym.utils import SYSTEM_PROMPTS
    except ImportError:
        raise DataError(f"{spec!r}: reasoning-gym is not installed: pip install 'lit-rl[reasoning-gym]'") from None
    for task in tasks if not trusted else ():
        found = scorer_evaluation(task)
        if found:
            raise DataError(
                f"{spec!r}: {task}'s scorer runs the model's answer as code ({found}); add {TRUST_OPTION}=true to the "
                "spec to train on it anyway, knowing that the model's text then runs in the trainer's process"
            )
    if trusted:
        _TRUSTED_SCORERS.update(tasks)
    try:
        if len(tasks) == 1:
            dataset = reasoning_gym.create_dataset(tasks[0], **options)
        else:
            from reasoning_gym.composite import DatasetSpec

            specs = [DatasetSpec(task, 1.0, {}) for task in tasks]
            dataset = reasoning_gym.create_dataset("composite", datasets=specs, **options)
        entries = list(dataset)
    except Exception as err:  # unknown task, a bad option: reasoning-gym's own message, on one line
        message = one_line(err)
        raise DataError(f"{spec!r}: reasoning-gym: {type(err).__name__}: {message}") from None
    # The task's own options (not `size` and `seed`), which some scorers read from their dataset's config
    # (decimal_arithmetic's decimal places): the reward builds the scorer with them (`OPTIONS_COLUMN`).
    scoring = {key: value for key, value in options.items() if key not in MIX_OPTIONS} if len(tasks) == 1 else {}
    _SCORING_OPTIONS.add((tasks[0], options_key(scoring)))
    rows = []
    for entry in entries:
        question = entry["question"]
        if style == "chat":
            prompt: Any = [
                {"role": "system", "content": SYSTEM_PROMPTS["default"]},
                {"role": "user", "content": question},
            ]
        else:
            prompt = question
        # `completion`: the reference answer in the prompt's style, for SFT (`SFTDataModule`) on the same spec.
        completion = f"<answer>{entry['answer']}</answer>" if style == "chat" else str(entry["answer"])
        row = {"prompt": prompt, "completion": completion, "answer": entry["answer"], "reasoning_gym": dict(entry)}
        row[OPTIONS_COLUMN] = dict(scoring)
        rows.append(row)
    return rows


@functools.lru_cache(maxsize=None)
def scorer_evaluation(task: str) -> Optional[str]:
    """Where `task`'s scorer runs text as code (`eval(` in SpiralMatrixDataset.score_answer), or None: its
    `score_answer` is read, with the methods and module functions it calls, two calls deep. A task reasoning-gym does
    not know is left to `create_dataset`, which names it."""
    from reasoning_gym.factory import DATASETS

    if task not in DATASETS:
        return None
    cls = DATASETS[task][0]
    module = inspect.getmodule(cls)
    seen: set[Any] = set()
    frontier: list[tuple[str, Callable[..., Any]]] = [(f"{cls.__name__}.score_answer", cls.score_answer)]
    for _ in range(3):  # score_answer, what it calls, what those call
        calls = []
        for where, function in frontier:
            if function in seen:
                continue
            seen.add(function)
            try:
                source = inspect.getsource(function)
            except (OSError, TypeError):
                continue
            match = EVALUATING.search(source)
            if match:
                return f"{match.group(1)}( in {where}"
            for name in set(re.findall(r"\b(?:self\.)?(\w+)\(", source)):
                callee = getattr(cls, name, None) or getattr(module, name, None)
                if inspect.isfunction(callee) or inspect.ismethod(callee):
                    calls.append((f"{getattr(callee, '__qualname__', name)}", callee))
        frontier = calls
    return None
