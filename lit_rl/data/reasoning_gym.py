"""reasoning-gym's procedural tasks as data (`pip install 'lit-rl[reasoning-gym]'`), offline:

    --data.train_data 'reasoning_gym:basic_arithmetic?size=2000&seed=1'
    --data.train_data 'reasoning_gym:basic_arithmetic?size=2000&seed=1&min_terms=2&max_terms=3'
    --data.train_data 'reasoning_gym:basic_arithmetic,leg_counting?size=2000&seed=1'     # a mix, equal weights

After `?` come the task's own options (`reasoning_gym.create_dataset(name, **options)`: `size`, `seed` and the task's
config fields; a value is read as JSON where it parses, `3`, `true`, `["+", "-"]`, and as text otherwise), and one of
lit-rl's: `prompt=text` (the default: the question as it is, for a base model) or `prompt=chat` (reasoning-gym's
default system prompt, which asks for the answer in `<answer>` tags, and the question as a user message). Several
tasks, comma-separated, make reasoning-gym's `composite` dataset with equal weights (then only `size`, `seed` and
`prompt` may be given). Each row holds `prompt`, `answer` and `reasoning_gym` (the task's entry: question, answer and
metadata), which `lit_rl.rewards.reasoning_gym.score` scores with the task's own scorer.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import parse_qsl

from lit_rl.errors import DataError

PREFIX = "reasoning_gym:"
PROMPT_STYLES = ("text", "chat")
MIX_OPTIONS = ("size", "seed")


def is_reasoning_gym(spec: str) -> bool:
    return spec.startswith(PREFIX)


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_spec(spec: str) -> tuple[list[str], dict[str, Any], str]:
    """`reasoning_gym:<task>[,<task>...][?<option>=<value>&...]` -> (tasks, the tasks' options, prompt style); a
    one-line `DataError` naming the spec when it cannot be read."""
    body, _, query = spec[len(PREFIX) :].partition("?")
    tasks = [task.strip() for task in body.split(",")]
    if not all(tasks):
        raise DataError(f"{spec!r}: name a reasoning-gym task after 'reasoning_gym:' (e.g. basic_arithmetic)")
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise DataError(f"{spec!r}: options go as key=value pairs joined by '&' after '?'") from None
    options: dict[str, Any] = {}
    for key, value in pairs:
        if key in options:
            raise DataError(f"{spec!r}: option {key!r} is given twice")
        options[key] = _value(value)
    style = options.pop("prompt", "text")
    if style not in PROMPT_STYLES:
        raise DataError(f"{spec!r}: prompt must be one of {', '.join(PROMPT_STYLES)}, got {style!r}")
    if len(tasks) > 1:
        others = sorted(set(options) - set(MIX_OPTIONS))
        if others:
            raise DataError(f"{spec!r}: a mix of tasks takes only size and seed, not {others[0]!r}")
    return tasks, options, style


def load_reasoning_gym_rows(spec: str) -> list[dict[str, Any]]:
    """The rows of `spec` (module docstring)."""
    tasks, options, style = parse_spec(spec)
    try:
        import reasoning_gym
        from reasoning_gym.utils import SYSTEM_PROMPTS
    except ImportError:
        raise DataError(f"{spec!r}: reasoning-gym is not installed: pip install 'lit-rl[reasoning-gym]'") from None
    try:
        if len(tasks) == 1:
            dataset = reasoning_gym.create_dataset(tasks[0], **options)
        else:
            from reasoning_gym.composite import DatasetSpec

            specs = [DatasetSpec(task, 1.0, {}) for task in tasks]
            dataset = reasoning_gym.create_dataset("composite", datasets=specs, **options)
        entries = list(dataset)
    except Exception as err:  # unknown task, a bad option: reasoning-gym's own message, on one line
        message = " ".join(str(err).split())
        raise DataError(f"{spec!r}: reasoning-gym: {type(err).__name__}: {message}") from None
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
        rows.append({"prompt": prompt, "answer": entry["answer"], "reasoning_gym": dict(entry)})
    return rows
