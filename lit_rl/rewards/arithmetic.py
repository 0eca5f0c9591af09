"""Rewards of the built-in addition task (`lit_rl.data.arithmetic`)."""

from __future__ import annotations

import re
from typing import Any, Sequence

from lit_rl.rewards import completion_text

_INTEGER = re.compile(r"-?\d+")


def _final_answer(completion: Any) -> str | None:
    """The completion's answer (text, or TRL's one-message form): the whole stripped text when it is an integer,
    else None."""
    text = completion_text(completion).strip()
    return text if _INTEGER.fullmatch(text) else None


def correctness(prompts: Sequence[Any], completions: Sequence[str], answer: Sequence[str], **_: Any) -> list[float]:
    """1.0 when the completion is exactly the integer in the `answer` column, else 0.0."""
    out = []
    for completion, expected in zip(completions, answer):
        found = _final_answer(completion)
        out.append(1.0 if found is not None and int(found) == int(expected) else 0.0)
    return out


def integer_format(prompts: Sequence[Any], completions: Sequence[str], **_: Any) -> list[float]:
    """1.0 when the completion is a bare integer (the answer format the task asks for), else 0.0."""
    return [1.0 if _final_answer(c) is not None else 0.0 for c in completions]


def final_answer_correctness(
    prompts: Sequence[Any], completions: Sequence[str], answer: Sequence[str], **_: Any
) -> list[float]:
    """1.0 when the transcript's final answer, the text after its last `</result>` (all of it when no tool was
    called), is exactly the integer in the `answer` column, else 0.0 (the built-in tool task,
    `builtin:tool_arithmetic`)."""
    return correctness(prompts, [completion_text(c).rsplit("</result>", 1)[-1] for c in completions], answer)
