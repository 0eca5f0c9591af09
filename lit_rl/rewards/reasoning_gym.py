"""reasoning-gym's scorers (`pip install 'lit-rl[reasoning-gym]'`): with data from `reasoning_gym:<task>`
(`lit_rl.data.reasoning_gym`), `--model.rewards.funcs '[lit_rl.rewards.reasoning_gym.score]'`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

from lit_rl.errors import RewardFunctionError
from lit_rl.rewards import completion_text


def _scorer(task: str) -> Callable[[Optional[str], dict[str, Any]], float]:
    """The task's own `score_answer` (of a dataset with the task's default options). One that runs text as code
    only where a spec of this run trusted it: a row names its task, and rows from a file are anyone's."""
    from lit_rl.data.reasoning_gym import TRUST_OPTION, scorer_evaluation, scorer_trusted

    found = None if scorer_trusted(task) else scorer_evaluation(task)
    if found:
        raise RewardFunctionError(
            f"reward function 'score': a row names reasoning-gym task {task!r}, whose scorer runs text as code "
            f"({found}); it runs only for rows of a spec that trusts it: data reasoning_gym:{task}?...&"
            f"{TRUST_OPTION}=true"
        )
    return _task_scorer(task)


@functools.lru_cache(maxsize=None)
def _task_scorer(task: str) -> Callable[[Optional[str], dict[str, Any]], float]:
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(task)


def answer_of(completion: str) -> str:
    """The answer a completion gives: the text of its last `<answer>...</answer>` (reasoning-gym's system prompt
    asks for one), else the whole completion, stripped (a base model answering the question directly)."""
    from reasoning_gym.utils import extract_answer

    tagged = extract_answer(completion, tag_name="answer")
    return tagged if tagged is not None else completion.strip()


def score(
    prompts: Sequence[Any], completions: Sequence[Any], reasoning_gym: Optional[Sequence[dict]] = None, **_: Any
) -> list[float]:
    """Each completion's score by its task's own scorer (`score_answer(answer, entry)`, in [0, 1]: 1.0 for a
    correct answer; some tasks give partial credit), on the answer `answer_of` finds. The task is the entry's
    `metadata.source_dataset`, so a mix of tasks is scored task by task. Scorers are built with the task's default
    options: a task whose scoring depends on an option you changed may score differently."""
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
    values = []
    for completion, entry in zip(completions, reasoning_gym):
        task = entry["metadata"]["source_dataset"]
        values.append(float(_scorer(task)(answer_of(completion_text(completion)), entry)))
    return values
