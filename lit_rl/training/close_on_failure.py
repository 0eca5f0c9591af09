"""Closing a run's rollouts when the run fails: Lightning runs a module's `teardown` only when its loop ends without
an exception."""

from __future__ import annotations

import sys

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint

from lit_rl.errors import exception_line


class ClosesRolloutsOnFailure(L.Callback):
    """Lightning runs a module's `teardown` only when its loop ends without an exception. A run that failed (an
    environment's error, a non-finite loss, a second Ctrl-C) left its rollouts running: a launched server, and rank
    0's rollout worker with a generation in flight, which the interpreter's exit waits for. The module adds this
    callback (`configure_callbacks`) to close its producer on the way out.

    Not where a checkpoint callback saves on exceptions (`OnExceptionCheckpoint`, `ModelCheckpoint(save_on_exception=
    True)`): Lightning runs checkpoint callbacks last, and their checkpoint records the generations in flight, which
    a closed producer has dropped. A close that fails is said in one line by the rank it failed on (each rank
    closes its own rollouts): Lightning's own handling of the run's error (its loggers' last rows) goes on."""

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        try:
            if not any(_saves_on_exception(callback) for callback in trainer.callbacks):
                pl_module.producer.close()
        except Exception as err:  # the run's own error is the one to report
            where = f"rank {trainer.global_rank}: " if trainer.world_size > 1 else ""
            reason = exception_line(err)
            sys.stderr.write(f"lit-rl: {where}closing the rollouts after the run's error failed too: {reason}\n")


def _saves_on_exception(callback: L.Callback) -> bool:
    return isinstance(callback, OnExceptionCheckpoint) or (
        isinstance(callback, ModelCheckpoint)
        and bool(getattr(callback, "save_on_exception", False))  # Lightning 2.5.3+
    )
