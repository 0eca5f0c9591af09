"""The built-in verifiable task: two-digit addition ("12+34=" -> "46").

Every (a, b) with 0 <= a, b < 100 is one row; a fixed permutation (independent of the training seed) holds out
`VAL_SIZE` rows for validation, so the splits never overlap and are the same on every machine.
"""

from __future__ import annotations

import torch

from lit_rl.errors import DataError

VAL_SIZE = 256
_SPLIT_SEED = 20240607


def addition_rows(split: str) -> list[dict[str, str]]:
    """Rows with `prompt`, `completion` (for SFT) and `answer` (for the reward functions)."""
    if split not in ("train", "val"):
        raise DataError(f"builtin:addition has splits 'train' and 'val', not {split!r}")
    pairs = [(a, b) for a in range(100) for b in range(100)]
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(_SPLIT_SEED)).tolist()
    chosen = order[:VAL_SIZE] if split == "val" else order[VAL_SIZE:]
    rows = []
    for index in chosen:
        a, b = pairs[index]
        rows.append({"prompt": f"{a}+{b}=", "completion": str(a + b), "answer": str(a + b)})
    return rows


BUILTIN_DATASETS = {"addition": addition_rows}


def addition_preference_rows(split: str) -> list[dict[str, str]]:
    """Preference pairs of the addition task: `chosen` is the right sum, `rejected` a near miss.

    The wrong answer is the sum plus an offset of +-1, +-2 or +-10 (kept non-negative), drawn with a fixed seed,
    so the data set is the same everywhere.
    """
    rows = addition_rows(split)
    generator = torch.Generator().manual_seed(_SPLIT_SEED + 1)
    offsets = [-10, -2, -1, 1, 2, 10]
    picks = torch.randint(len(offsets), (len(rows),), generator=generator).tolist()
    out = []
    for row, pick in zip(rows, picks):
        answer = int(row["answer"])
        wrong = answer + offsets[pick]
        if wrong < 0:
            wrong = answer - offsets[pick]
        out.append({"prompt": row["prompt"], "chosen": str(answer), "rejected": str(wrong), "answer": row["answer"]})
    return out


BUILTIN_DATASETS["addition_preference"] = addition_preference_rows


# -- the built-in tool task --------------------------------------------------------------------------------------
TOOL_TRAIN_SIZE = 20_000
TOOL_TOOL_FRACTION = 0.5  # of the SFT completions: transcripts that call the tool; the others answer directly
_TOOL_SEED = 20261124
EOS_TEXT = "<|endoftext|>"  # the tiny tokenizer's EOS: it ends the model's first turn in a transcript


def tool_transcript(expression: str, answer: str) -> str:
    """What a model that uses the calculator writes, with the tool's answer between its turns: a call that ends its
    first turn, the observation, then the answer (`lit_rl.envs.tools` syntax)."""
    return f"<calc>{expression}</calc>{EOS_TEXT}<result>{answer}</result>{answer}"


def tool_arithmetic_rows(split: str) -> list[dict[str, str]]:
    """`a+b=` and `a*b=` for 3-4 digit a and b (100-9999): the tiny model cannot compute them, and with the `calc`
    tool it only copies. `answer` for the reward functions; `completion` (for the SFT warm start) is the tool
    transcript on a fixed `TOOL_TOOL_FRACTION` of the rows and the bare answer on the others, so that the warm start
    has both habits and RL must find which one pays. Drawn with a fixed seed; `val` (256 rows) and `train` share no
    prompt."""
    if split not in ("train", "val"):
        raise DataError(f"builtin:tool_arithmetic has splits 'train' and 'val', not {split!r}")
    generator = torch.Generator().manual_seed(_TOOL_SEED)
    count = TOOL_TRAIN_SIZE + 2 * VAL_SIZE  # val draws from a margin that duplicates are dropped from
    operands = torch.randint(100, 10_000, (count, 2), generator=generator).tolist()
    multiply = (torch.rand(count, generator=generator) < 0.5).tolist()
    with_tool = (torch.rand(count, generator=generator) < TOOL_TOOL_FRACTION).tolist()
    rows, seen = [], set()
    for (a, b), times, tool in zip(operands, multiply, with_tool):
        expression = f"{a}*{b}" if times else f"{a}+{b}"
        if expression in seen:
            continue
        seen.add(expression)
        answer = str(a * b if times else a + b)
        completion = tool_transcript(expression, answer) if tool else answer
        rows.append({"prompt": f"{expression}=", "completion": completion, "answer": answer})
    return rows[:VAL_SIZE] if split == "val" else rows[VAL_SIZE : VAL_SIZE + TOOL_TRAIN_SIZE]


BUILTIN_DATASETS["tool_arithmetic"] = tool_arithmetic_rows
