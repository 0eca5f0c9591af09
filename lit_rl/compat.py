"""The private state of Lightning that lit-rl must touch, in one place: each use is named here, so an upgrade that
renames it breaks one function (and its test), not a call site deep in a callback.

Lightning 2.5-2.6: `ModelCheckpoint._last_global_step_saved` (the step it last saved) and
`ModelCheckpoint._last_checkpoint_saved` (the path it last saved) decide whether it saves again.
"""

from __future__ import annotations

from lightning.pytorch.callbacks import ModelCheckpoint


def mark_step_saved(callback: ModelCheckpoint, step: int) -> None:
    """Tell `callback` that `step` is saved already, so that it does not save that step again."""
    callback._last_global_step_saved = max(callback._last_global_step_saved, step)


def mark_last_written(callback: ModelCheckpoint, path: str, step: int) -> None:
    """Tell `callback` that `path` is its last checkpoint, written at `step`: it writes no other one for that step
    (at the end of the epoch or of `fit`)."""
    callback._last_checkpoint_saved = path
    mark_step_saved(callback, step)
