"""Callbacks: progress display and run summary, Hugging Face export, safety (non-finite guard, graceful stop)."""

from lit_rl.callbacks.export import SaveHFPretrained
from lit_rl.callbacks.progress import StepProgressBar
from lit_rl.callbacks.safety import GracefulStop, NonFiniteError, NonFiniteGuard
from lit_rl.callbacks.summary import RunSummary, headline_metrics

__all__ = [
    "GracefulStop",
    "NonFiniteError",
    "NonFiniteGuard",
    "RunSummary",
    "SaveHFPretrained",
    "StepProgressBar",
    "headline_metrics",
]
