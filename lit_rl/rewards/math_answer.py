"""Math answers checked with `math-verify` (the checker TRL's `accuracy_reward` and open-r1 use): install the extra
`pip install "lit-rl[math]"`, then `rewards: {funcs: [lit_rl.rewards.math_answer.accuracy]}`.
"""

from __future__ import annotations

import threading
from typing import Any, Optional, Sequence

from lit_rl.errors import RewardFunctionError
from lit_rl.rewards import completion_text

PARSE_TIMEOUT_S = 10
VERIFY_TIMEOUT_S = 5


def accuracy(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    solution: Optional[Sequence[str]] = None,
    answer: Optional[Sequence[str]] = None,
    **_: Any,
) -> list[Optional[float]]:
    """1.0 when the completion's answer (LaTeX, `\\boxed{}` first) equals the gold one mathematically, else 0.0;
    None (unscorable) when the gold answer itself does not parse. The gold answer is the `solution` column (TRL's
    name), else `answer`.

    As in TRL: the completion's answer must be LaTeX (inside `$...$`, `\\(...\\)` or `\\boxed{}`), units are
    normalised, and the first match is taken.
    """
    try:
        from latex2sympy2_extended import NormalizationConfig
        from math_verify import LatexExtractionConfig, parse, verify
    except ImportError:
        raise RewardFunctionError(
            "reward function 'accuracy' needs math-verify: pip install \"lit-rl[math]\""
        ) from None
    gold_answers = solution if solution is not None else answer
    if gold_answers is None:
        raise RewardFunctionError("reward function 'accuracy' needs a 'solution' (or 'answer') column in the data")
    # math-verify's time limits use signal.alarm, which only the main thread may set.
    main = threading.current_thread() is threading.main_thread()
    parse_timeout, verify_timeout = (PARSE_TIMEOUT_S, VERIFY_TIMEOUT_S) if main else (None, None)
    extraction = [
        LatexExtractionConfig(
            normalization_config=NormalizationConfig(units=True),
            boxed_match_priority=0,  # \boxed{} first
            try_extract_without_anchor=False,
        )
    ]
    rewards: list[Optional[float]] = []
    for completion, gold in zip(completions, gold_answers):
        gold_parsed = parse(str(gold), parsing_timeout=parse_timeout)
        if not gold_parsed:
            rewards.append(None)
            continue
        found = parse(
            completion_text(completion),
            extraction_config=extraction,
            extraction_mode="first_match",
            parsing_timeout=parse_timeout,
        )
        rewards.append(float(verify(gold_parsed, found, timeout_seconds=verify_timeout)))
    return rewards
