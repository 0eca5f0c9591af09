"""Reward functions: plain callables `(prompts, completions, **columns) -> list[float]`.

They are referenced from YAML by import path (`lit_rl.rewards.arithmetic.correctness` or
`my_pkg.rewards:score`), and only from paths the user wrote: nothing is looked up by name elsewhere.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from lit_rl.errors import RewardFunctionError
from lit_rl.importing import import_callable

RewardFunction = Callable[..., Sequence[float]]


def import_reward_function(path: str) -> RewardFunction:
    """Import `package.module.function` or `package.module:function`; a clear error names `path` otherwise."""
    try:
        return import_callable(path, "reward function")
    except ValueError as err:
        raise RewardFunctionError(str(err)) from None


def reward_name(path: str) -> str:
    """Short metric name of a reward function path: its last component."""
    return path.replace(":", ".").rsplit(".", 1)[-1]


def call_reward_function(
    name: str, fn: RewardFunction, prompts: list[Any], completions: list[str], columns: dict[str, list[Any]]
) -> list[float]:
    """Call `fn` and check what it returns: one float per completion; None becomes NaN (an invalid reward, handled
    by the algorithm's `invalid_reward` policy). A function that raises or returns the wrong number of values is
    a `RewardFunctionError` naming it."""
    try:
        values = list(fn(prompts=prompts, completions=completions, **columns))
    except Exception as err:  # the user's code: report it by name, keep the cause for LIT_RL_TRACEBACK=1
        raise RewardFunctionError(f"reward function {name!r} raised {type(err).__name__}: {err}") from err
    if len(values) != len(completions):
        raise RewardFunctionError(
            f"reward function {name!r} returned {len(values)} values for {len(completions)} completions"
        )
    out = []
    for row, value in enumerate(values):
        if value is None:
            out.append(math.nan)
            continue
        try:
            out.append(float(value))
        except (TypeError, ValueError):
            raise RewardFunctionError(f"reward function {name!r} returned {value!r} for completion {row}, not a number")
    return out
