"""A reader's reward functions, TRL's convention: `(prompts, completions, **columns) -> list[float]`."""


def _text(completion) -> str:
    """A completion as text: itself, or the content of its last chat message (conversational rows)."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


def accuracy(prompts, completions, answer, **kwargs) -> list[float]:
    """1 when the completion's last word is the row's answer."""
    words = [_text(completion).split() for completion in completions]
    return [float(bool(w) and w[-1].strip(".") == str(a)) for w, a in zip(words, answer)]


def format_reward(completions, **kwargs) -> list[float]:
    """1 when the completion is not empty."""
    return [float(bool(_text(completion).strip())) for completion in completions]
