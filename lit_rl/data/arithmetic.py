"""The built-in verifiable task: two-digit addition ("12+34=" -> "46").

Every (a, b) with 0 <= a, b < 100 is one row; a fixed permutation (independent of the training seed) holds out
`VAL_SIZE` rows for validation, so the splits never overlap and are the same on every machine.
"""

from __future__ import annotations

import torch

VAL_SIZE = 256
_SPLIT_SEED = 20240607


def addition_rows(split: str) -> list[dict[str, str]]:
    """Rows with `prompt`, `completion` (for SFT) and `answer` (for the reward functions)."""
    if split not in ("train", "val"):
        raise ValueError(f"builtin:addition has splits 'train' and 'val', not {split!r}")
    pairs = [(a, b) for a in range(100) for b in range(100)]
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(_SPLIT_SEED)).tolist()
    chosen = order[:VAL_SIZE] if split == "val" else order[VAL_SIZE:]
    rows = []
    for index in chosen:
        a, b = pairs[index]
        rows.append({"prompt": f"{a}+{b}=", "completion": str(a + b), "answer": str(a + b)})
    return rows


BUILTIN_DATASETS = {"addition": addition_rows}
