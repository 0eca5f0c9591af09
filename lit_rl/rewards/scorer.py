"""The reward functions of an on-policy run (`model.rewards`) as one part: which functions, their weights, and the
scores of a batch of completions (`reward_components`: one column per function, each function called as TRL calls it
and its values checked, `call_reward_functions`; `weighted_reward`: their weighted sum). It reads nothing of its
holder (the rollout producer, `lit_rl.rollout.producer`): the producer passes what a score needs (the decoded
completions, the device, where training is) and stops every rank together when one fails.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import math
from typing import TYPE_CHECKING, Any, Iterable, Optional, Sequence

import numpy as np
import torch

from lit_rl.errors import ConfigError, RewardFunctionError, exception_line, one_line
from lit_rl.rewards import (
    NOT_PASSED_COLUMNS,
    RewardFunction,
    TrainerState,
    as_messages,
    import_reward_function,
    is_conversational,
    log_extra,
    log_metric,
    reward_names,
)

if TYPE_CHECKING:  # the config imports Lightning; reward scoring does not need it
    from lit_rl.config import RewardArgs

DEFAULT_REWARD = "lit_rl.rewards.arithmetic.correctness"  # the built-in task's
ENV_PART_PREFIX = "env/"  # the columns of an environment's reward parts, after the functions': env/<part>


class RewardScorer:
    """The run's reward functions, by name, and their weights.

    Args:
        args: `model.rewards`: the functions by import path (None: the built-in task's correctness reward; an empty
            list: none, an algorithm adds its own with `add`), their weights (None: 1 each) and what an invalid
            reward counts as (`on_invalid`).
    """

    def __init__(self, args: RewardArgs) -> None:
        paths = [DEFAULT_REWARD] if args.funcs is None else args.funcs
        names = reward_names(paths)
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ConfigError(f"model.rewards.funcs: two functions are named {duplicates[0]!r}; names must be unique")
        self.functions: dict[str, Any] = {name: import_reward_function(path) for name, path in zip(names, paths)}
        self.weights = torch.tensor(args.weights or [1.0] * len(paths), dtype=torch.float32)
        if len(self.weights) != len(paths):
            raise ConfigError(
                f"model.rewards.weights has {len(self.weights)} values for {len(paths)} functions in "
                "model.rewards.funcs: give one weight per function (--model.rewards.weights '[1.0, ...]'), or null "
                "for 1.0 each"
            )
        self.on_invalid = args.on_invalid

    @property
    def names(self) -> list[str]:
        """The functions' names, in column order."""
        return list(self.functions)

    def add(self, name: str, fn: Any, weight: float) -> None:
        """Add a reward function that is not imported by path (a reward model)."""
        self.functions[name] = fn
        self.weights = torch.cat([self.weights, torch.tensor([weight])])

    def score(
        self,
        rows: list[dict[str, Any]],
        completions: list[str],
        completion_ids: list[list[int]],
        repeat: int,
        device: torch.device,
        state: TrainerState,
        names: Sequence[str],
        env_rewards: Optional[torch.Tensor] = None,
        environments: Optional[list[Any]] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Reward components [N, F] and weighted rewards [N] (`reward_components`, `weighted_reward`) of the
        completions of `rows` x `repeat`; an environment's reward parts [N, E] are further columns, of weight 1.
        `names`: every column's name, for the messages about invalid rewards; `environments`: the episodes'
        environments, one per completion, passed as `environments=` (TRL's keyword). Raises `RewardFunctionError`."""
        components = reward_components(
            self.functions, rows, completions, repeat, device, completion_ids, state, environments
        )
        weights = self.weights
        if env_rewards is not None:
            components = torch.cat([components, env_rewards.to(components)], dim=1)
            weights = torch.cat([weights, torch.ones(env_rewards.shape[1])])
        return components, weighted_reward(components, weights, list(names), self.on_invalid)


def reward_components(
    reward_fns: dict[str, RewardFunction],
    rows: list[dict[str, Any]],
    completions: list[str],
    repeat: int,
    device: torch.device,
    completion_ids: Optional[list[list[int]]] = None,
    trainer_state: Optional[TrainerState] = None,
    environments: Optional[list[Any]] = None,
) -> torch.Tensor:
    """Reward components [N, F] (one column per reward function) of `completions` [N] of `rows` repeated `repeat`
    times, the functions called with TRL's keywords (`lit_rl.rewards`): message completions for chat prompts,
    `completion_ids`, `trainer_state`, `environments` (episodes' environments, when there are), and every column of
    the rows but `NOT_PASSED_COLUMNS` (None for a row without it)."""
    prompts = [row["prompt"] for row in rows for _ in range(repeat)]
    # Every column of any row (in the order first seen; None where a row lacks it), so that a function's keywords do
    # not depend on which row comes first in the batch.
    keys = dict.fromkeys(key for row in rows for key in row if key not in NOT_PASSED_COLUMNS)
    columns = {key: [row.get(key) for row in rows for _ in range(repeat)] for key in keys}
    columns["completion_ids"] = completion_ids
    columns["trainer_state"] = trainer_state
    columns["log_extra"], columns["log_metric"] = log_extra, log_metric
    if environments is not None:
        columns["environments"] = environments
    passed: list[Any] = as_messages(completions) if prompts and is_conversational(prompts[0]) else completions
    values = call_reward_functions(reward_fns, prompts, passed, columns)
    if not reward_fns:  # an environment's reward parts alone
        return torch.zeros(len(completions), 0, device=device)
    return torch.tensor(values, dtype=torch.float32, device=device).T.reshape(len(completions), -1)


def weighted_reward(
    components: torch.Tensor, weights: torch.Tensor, names: list[str], invalid_reward: str = "zero"
) -> torch.Tensor:
    """[N, F] -> [N]: `sum_f weights[f] * components[:, f]`.

    An invalid value (NaN, inf, or None from the function) counts as 0 with `model.rewards.on_invalid: zero` (the
    default; `frac_invalid_reward` counts them) and stops the run, naming the function or the environment's reward
    part (`names[f]`), with `error`.
    """
    invalid = ~torch.isfinite(components)
    if invalid.any() and invalid_reward == "error":
        row, column = (int(i) for i in invalid.nonzero()[0])
        source = "environment reward part" if names[column].startswith(ENV_PART_PREFIX) else "reward function"
        raise RewardFunctionError(
            f"{source} {names[column]!r} returned {components[row, column].item()} for completion {row} "
            "(set model.rewards.on_invalid: zero to count invalid rewards as 0)"
        )
    return (torch.where(invalid, torch.zeros_like(components), components) * weights.to(components)).sum(dim=1)


# What a reward function (the user's code) may raise that is its failure, not this process's to act on: any
# error, and `sys.exit()` too, which would otherwise end the run silently with exit 0 (the environment's calls are
# caught alike). Ctrl-C (KeyboardInterrupt) still stops the run.
USER_CODE_ERRORS = (Exception, SystemExit)


def raised(name: str, err: BaseException) -> RewardFunctionError:
    """The one-line error for a reward function that raised `err`, naming the function and the exception (its
    message's first line, at most 300 characters)."""
    return RewardFunctionError(f"reward function {name!r} raised {one_line(exception_line(err), 300)}")


def call_reward_function(
    name: str, fn: RewardFunction, prompts: list[Any], completions: list[Any], columns: dict[str, Any]
) -> list[float]:
    """Call `fn` and check what it returns (`checked_values`). A function that raises is a `RewardFunctionError`
    naming it."""
    try:
        result = fn(prompts=prompts, completions=completions, **columns)
    except RewardFunctionError:
        raise
    except USER_CODE_ERRORS as err:  # the user's code: report it by name, keep the cause for LIT_RL_TRACEBACK=1
        raise raised(name, err) from err
    return checked_values(name, result, len(completions))


def call_reward_functions(
    reward_fns: dict[str, RewardFunction], prompts: list[Any], completions: list[Any], columns: dict[str, Any]
) -> list[list[float]]:
    """Every function's values (`call_reward_function`), in order; the asynchronous ones (`async def`, or an object
    whose `__call__` is, which `inspect.iscoroutinefunction` does not see on the object) are awaited together in one
    event loop, so that they score the batch concurrently."""
    asynchronous = [
        name
        for name, fn in reward_fns.items()
        if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))
    ]
    calls = {}
    for name in asynchronous:
        try:  # a wrong signature raises here, when the coroutine is made
            calls[name] = reward_fns[name](prompts=prompts, completions=completions, **columns)
        except USER_CODE_ERRORS as err:
            for call in calls.values():
                call.close()
            raise raised(name, err) from err
    try:
        results = dict(zip(calls, _await_all(list(calls.values()))))
    except SystemExit as err:  # asyncio lets it through `gather`, so which function raised it is not known
        raise RewardFunctionError(f"an asynchronous reward function ({', '.join(calls)}) raised SystemExit") from err
    out = []
    for name, fn in reward_fns.items():
        if name not in results:
            out.append(call_reward_function(name, fn, prompts, completions, columns))
            continue
        result = results[name]
        if isinstance(result, BaseException):
            raise raised(name, result) from result
        out.append(checked_values(name, result, len(completions)))
    return out


def _await_all(coroutines: list[Any]) -> list[Any]:
    """The coroutines' results (or exceptions), awaited concurrently in a new event loop (in a worker thread when
    this thread already runs one, e.g. in a notebook)."""
    if not coroutines:
        return []

    async def gather() -> list[Any]:
        return await asyncio.gather(*coroutines, return_exceptions=True)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(gather())
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, gather()).result()


def checked_values(name: str, result: Any, count: int) -> list[float]:
    """What a function returned as floats, one per completion (None becomes NaN); a `RewardFunctionError` naming it
    otherwise. A list, tuple, generator, numpy array or tensor is a list of numbers; a text is not read as one value
    per character, nor a number as a failed iteration."""
    values = result.tolist() if isinstance(result, (np.ndarray, torch.Tensor)) else result
    if isinstance(values, (str, bytes, dict)) or not isinstance(values, Iterable):
        raise RewardFunctionError(
            f"reward function {name!r} returned {one_line(repr(result), 80)}, not a list of numbers"
        )
    try:
        values = list(values)  # a generator too, as TRL reads it: its code runs here
    except USER_CODE_ERRORS as err:
        raise raised(name, err) from err
    if len(values) != count:
        raise RewardFunctionError(f"reward function {name!r} returned {len(values)} values for {count} completions")
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
