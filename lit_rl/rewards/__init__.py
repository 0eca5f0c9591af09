"""Reward functions: plain callables `(prompts, completions, **columns) -> list[float]`.

They are referenced from YAML by import path (`lit_rl.rewards.arithmetic.correctness` or
`my_pkg.rewards:score`), and only from paths the user wrote: nothing is looked up by name elsewhere.
"""

from __future__ import annotations

import importlib
import math
from typing import Any, Callable, Sequence

RewardFunction = Callable[..., Sequence[float]]


def import_reward_function(path: str) -> RewardFunction:
    """Import `package.module.function` or `package.module:function`; a clear error names `path` otherwise."""
    module_name, sep, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward function path {path!r} must look like 'package.module.function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"reward function {path!r}: cannot import module {module_name!r} ({err})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward function {path!r}: module {module_name!r} has no callable {attr!r}")
    return fn


def reward_name(path: str) -> str:
    """Short metric name of a reward function path: its last component."""
    return path.replace(":", ".").rsplit(".", 1)[-1]


def call_reward_function(
    name: str, fn: RewardFunction, prompts: list[Any], completions: list[str], columns: dict[str, list[Any]]
) -> list[float]:
    """Call `fn` and check what it returns: one finite-or-NaN float per completion."""
    values = list(fn(prompts=prompts, completions=completions, **columns))
    if len(values) != len(completions):
        raise ValueError(f"reward function {name!r} returned {len(values)} values for {len(completions)} completions")
    out = []
    for value in values:
        if value is None:
            out.append(math.nan)
        else:
            out.append(float(value))
    return out
