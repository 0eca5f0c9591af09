"""reasoning-gym's scorers (`pip install 'lit-rl[reasoning-gym]'`): with data from `reasoning_gym:<task>`
(`lit_rl.data.reasoning_gym`), `--model.rewards.funcs '[lit_rl.rewards.reasoning_gym.score]'`.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Callable, Optional, Sequence

from lit_rl.errors import RewardFunctionError
from lit_rl.rewards import completion_text


def _scorer(task: str, options: dict[str, Any]) -> Callable[[Optional[str], dict[str, Any]], float]:
    """The task's own `score_answer`, of a dataset built with the task `options` of the spec that made the row. One
    that runs text as code only where a spec of this run trusted it, and options only a spec of this run gave: a
    row names its task and options, and rows from a file are anyone's."""
    from lit_rl.data.reasoning_gym import (
        OPTIONS_COLUMN,
        TRUST_OPTION,
        options_key,
        scorer_evaluation,
        scorer_trusted,
        scoring_options_registered,
    )

    found = None if scorer_trusted(task) else scorer_evaluation(task)
    if found:
        raise RewardFunctionError(
            f"reward function 'score': a row names reasoning-gym task {task!r}, whose scorer runs text as code "
            f"({found}); it runs only for rows of a spec that trusts it: data reasoning_gym:{task}?...&"
            f"{TRUST_OPTION}=true"
        )
    if options and not scoring_options_registered(task, options):
        raise RewardFunctionError(
            f"reward function 'score': a row names reasoning-gym task {task!r} with options {options_key(options)}, "
            "which no reasoning_gym: spec of this run gave: its scorer is built only with a spec's options (rows "
            f"from a data file: train on the spec that made them, reasoning_gym:{task}?...; or drop the file's "
            f"{OPTIONS_COLUMN} column to score with reasoning-gym's defaults)"
        )
    return _task_scorer(task, options_key(options))


@functools.lru_cache(maxsize=None)
def _task_scorer(task: str, options: str) -> Callable[[Optional[str], dict[str, Any]], float]:
    """`score_answer` of the task's dataset with `options` (JSON; `{}`: reasoning-gym's defaults). Some scorers read
    their config (decimal_arithmetic's decimal places, time_intervals' tolerance): with the defaults a wrong answer
    scored 1.0 where the spec's own dataset scores 0.0."""
    import reasoning_gym

    chosen = json.loads(options)
    if not chosen:
        return reasoning_gym.get_score_answer_fn(task)
    return reasoning_gym.create_dataset(task, size=1, seed=0, **chosen).score_answer


def answer_of(completion: str) -> str:
    """The answer a completion gives: the text of its last `<answer>...</answer>` (reasoning-gym's system prompt
    asks for one), else the whole completion, stripped (a base model answering the question directly)."""
    from reasoning_gym.utils import extract_answer

    tagged = extract_answer(completion, tag_name="answer")
    return tagged if tagged is not None else completion.strip()


def score(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    reasoning_gym: Optional[Sequence[dict]] = None,
    reasoning_gym_options: Optional[Sequence[Optional[dict]]] = None,
    **_: Any,
) -> list[float]:
    """Each completion's score by its task's own scorer (`score_answer(answer, entry)`, in [0, 1]: 1.0 for a
    correct answer; some tasks give partial credit), on the answer `answer_of` finds. The task is the entry's
    `metadata.source_dataset`, so a mix of tasks is scored task by task; the scorer's dataset has the options the
    spec gave the task (`reasoning_gym_options`, a column of the spec's rows; reasoning-gym's defaults without)."""
    try:
        import reasoning_gym as _  # noqa: F401
    except ImportError:
        raise RewardFunctionError(
            "reward function 'score' needs reasoning-gym: pip install 'lit-rl[reasoning-gym]'"
        ) from None
    if reasoning_gym is None:
        raise RewardFunctionError(
            "reward function 'score' needs the 'reasoning_gym' column: give data from reasoning_gym:<task>"
        )
    options = reasoning_gym_options if reasoning_gym_options is not None else [None] * len(reasoning_gym)
    values = []
    for completion, entry, chosen in zip(completions, reasoning_gym, options):
        task = entry["metadata"]["source_dataset"]
        values.append(float(_scorer(task, chosen or {})(answer_of(completion_text(completion)), entry)))
    return values
