"""Reward functions: plain callables `(prompts, completions, **kwargs) -> list[float]`, called as TRL's
`GRPOTrainer` calls them, so TRL's reward functions run unchanged:

- `prompts`: the rows' `prompt` column (text, or chat messages), each repeated once per completion;
- `completions`: text, or, when the prompts are chat messages, each completion as one assistant message
  `[{"role": "assistant", "content": text}]` (TRL's convention: `completion[0]["content"]`);
- `completion_ids`: each completion's token ids (up to and including its EOS), a list of int lists;
- `trainer_state`: a `TrainerState` (`global_step`, `max_steps`, `epoch`), for rewards that change with training;
- every other column of the batch's rows (`answer`, `solution`, ...), by name (None for a row without it);
- `log_extra` and `log_metric`, TRL 1.16's hooks for a function's own logging (`log_extra`: columns of TRL's table
  of completions, which lit-rl does not keep, so they are accepted and dropped; `log_metric`: a scalar, which
  lit-rl does not log: calling it stops the run naming the function, with the way lit-rl logs a number of a
  reward function's: a further function in `model.rewards.funcs`, of weight 0, whose mean is logged as
  `rewards/<name>`).

A function returns a list (or tuple, generator, numpy array, tensor) of one float per completion; `None` marks a
completion it cannot score. lit-rl counts such a value as 0 in the weighted sum (`model.rewards.on_invalid: zero`,
the default, as TRL's `nansum` does for a function that returned None) and in the metric `frac_invalid_reward`;
`model.rewards.on_invalid: error` stops the run naming the function. (TRL 1.16 also leaves a completion for which
*every* function returned None out of its group's baseline; lit-rl scores it 0.)

They are referenced from YAML by import path (`lit_rl.rewards.arithmetic.correctness` or
`my_pkg.rewards:score`), and only from paths the user wrote: nothing is looked up by name elsewhere. A function may
be `async def` with the same signature (or an object whose `__call__` is): the async functions of a batch are
awaited together, concurrently (`lit_rl.rewards.scorer.call_reward_functions`). A URL
(`http://127.0.0.1:8000/score`) is a reward served over HTTP (`lit_rl.rewards.http`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from lit_rl.errors import RewardFunctionError
from lit_rl.importing import import_callable
from lit_rl.rewards.http import HTTPReward, is_url, url_address, url_reward_name

RewardFunction = Callable[..., Sequence[float]]

# Row columns that never reach a reward function as such: TRL drops them too (the keywords are the completions',
# and TRL's logging hooks).
NOT_PASSED_COLUMNS = ("prompt", "completion", "completion_ids", "trainer_state", "log_extra", "log_metric")


def log_extra(column: str, values: list[Any]) -> None:
    """TRL's `log_extra` keyword: a column of its table of completions. lit-rl keeps no such table: dropped."""


def log_metric(name: str, value: float) -> None:
    """TRL's `log_metric` keyword: a scalar TRL averages over its logging step. lit-rl logs only metrics it can
    reduce exactly over ranks, declared before the run (a name one rank logs and another does not would break that),
    so a call stops the run, naming the function (`call_reward_function`) and the way to log the number."""
    raise NotImplementedError(
        f"log_metric({name!r}, ...) is TRL's; lit-rl does not log a reward function's own metrics: compute the number "
        "in a further function of model.rewards.funcs, of weight 0 (its mean is logged as rewards/<its name>)"
    )


@dataclass(frozen=True)
class TrainerState:
    """Where training is when a reward is computed: the optimizer steps done, the steps planned (-1: no limit),
    the epoch. The names of transformers' `TrainerState`, which TRL passes as `trainer_state`."""

    global_step: int
    max_steps: int
    epoch: float


def is_conversational(prompt: Any) -> bool:
    """Whether a prompt is chat messages (a list of `{"role": ..., "content": ...}`), as TRL decides it."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict) and "role" in prompt[0]


def as_messages(completions: Sequence[str]) -> list[list[dict[str, str]]]:
    """Each completion as TRL hands it to reward functions for chat prompts: one assistant message."""
    return [[{"role": "assistant", "content": text}] for text in completions]


def completion_text(completion: Any) -> str:
    """The text of a completion in either form: itself, or the content of its last message."""
    if isinstance(completion, str):
        return completion
    return str(completion[-1]["content"]) if completion else ""


def import_reward_function(path: str) -> RewardFunction:
    """Import `package.module.function` or `package.module:function` (or reach the reward served at a URL); a clear
    error names `path` otherwise."""
    if is_url(path):
        return HTTPReward(path)
    try:
        return import_callable(path, "reward function")
    except ValueError as err:
        raise RewardFunctionError(str(err)) from None


def reward_name(path: str) -> str:
    """Short metric name of a reward function path: its last component (a URL: its last path segment)."""
    if is_url(path):
        return url_reward_name(path)
    return path.replace(":", ".").rsplit(".", 1)[-1]


def reward_names(paths: Sequence[str]) -> list[str]:
    """Each path's `reward_name`; URLs that would share one (`http://h:8000/score`, `http://h:8001/score`) are told
    apart by their address (`score_h_8000`): a URL's name cannot be chosen, a function's can (by its own name)."""
    names = [reward_name(path) for path in paths]
    shared = {name for name in names if names.count(name) > 1}
    return [
        f"{name}_{url_address(path)}" if name in shared and is_url(path) else name for name, path in zip(names, paths)
    ]
