"""Callbacks: progress display, Hugging Face export, and (later) weight sync to rollout engines."""

from lit_rl.callbacks.export import SaveHFPretrained
from lit_rl.callbacks.progress import StepProgressBar
from lit_rl.callbacks.safety import GracefulStop, NonFiniteError, NonFiniteGuard

__all__ = ["GracefulStop", "NonFiniteError", "NonFiniteGuard", "SaveHFPretrained", "StepProgressBar"]
