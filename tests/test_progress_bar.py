"""The progress bar of a step-bounded run counts optimizer steps: under gradient accumulation and after a resume."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

from lit_rl.callbacks import StepProgressBar


class WhatTheBarShows(L.Callback):
    """Records (completed, total) of the training bar after each micro-batch."""

    def __init__(self, bar: StepProgressBar) -> None:
        self.bar, self.shown = bar, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        task = self.bar.progress.tasks[self.bar.train_progress_bar_id]  # the bar, first in the list, updated it
        self.shown.append((task.completed, task.total))


def _fit(tmp_path, max_steps: int, ckpt_path=None) -> WhatTheBarShows:
    bar = StepProgressBar()
    probe = WhatTheBarShows(bar)
    trainer = L.Trainer(
        max_steps=max_steps,
        accumulate_grad_batches=2,
        callbacks=[bar, probe, ModelCheckpoint(dirpath=tmp_path, save_last=True)],
        default_root_dir=tmp_path,
        logger=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(BoringModel(), ckpt_path=ckpt_path)
    return probe


def test_the_bar_counts_optimizer_steps_under_accumulation_and_after_a_resume(tmp_path):
    # Lightning's own bar showed 12/6 here (micro-batches against steps), and 6/3 after the resume.
    first = _fit(tmp_path, max_steps=6).shown
    assert first == [(step, 6) for step in (0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6)]
    resumed = _fit(tmp_path, max_steps=9, ckpt_path=tmp_path / "last.ckpt").shown
    assert resumed == [(step, 9) for step in (6, 7, 7, 8, 8, 9)]
