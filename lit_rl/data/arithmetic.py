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
