"""The progress bar of a step-bounded run counts optimizer steps: under gradient accumulation and after a resume."""

from __future__ import annotations

import re

import lightning as L
import rich
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


class LogsAReward(BoringModel):
    def training_step(self, batch, batch_idx):
        self.log("train/reward", 0.5, prog_bar=True)
        return super().training_step(batch, batch_idx)


def _printed_lines(tmp_path, capsys, bar: StepProgressBar) -> list[str]:
    """The plain lines a 3-step run (2 micro-batches a step) printed to a stdout that is no terminal."""
    trainer = L.Trainer(
        max_steps=3,
        accumulate_grad_batches=2,
        callbacks=[bar],
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    capsys.readouterr()
    trainer.fit(LogsAReward())
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]


def test_without_a_terminal_the_bar_prints_plain_lines(tmp_path, capsys, monkeypatch):
    """nohup, SLURM, `| tee`: rich draws nothing until the end, so the bar prints what it shows as a line, at the
    first step and then at most every `line_every_s` seconds (after a whole optimizer step, never mid-accumulation)."""
    for variable in ("TTY_COMPATIBLE", "FORCE_COLOR"):  # rich's overrides of its terminal test
        monkeypatch.delenv(variable, raising=False)
    first = _printed_lines(tmp_path, capsys, StepProgressBar())  # every 30 s: a run this short has its first only
    assert len(first) == 1 and re.fullmatch(r"step 1/3  train/reward 0\.5  [\d.e+-]+ s/step  ETA 0:00:\d\d", first[0])
    every = _printed_lines(tmp_path, capsys, StepProgressBar(line_every_s=0))
    assert [line.split("  ")[0] for line in every] == ["step 1/3", "step 2/3", "step 3/3"]
    assert every[-1].endswith("ETA 0:00:00")


def test_in_a_terminal_the_bar_prints_no_plain_lines(tmp_path, capsys):
    try:
        assert _printed_lines(tmp_path, capsys, StepProgressBar(console_kwargs={"force_terminal": True})) == []
    finally:
        rich.reconfigure()  # the global console the bar configured, as any other bar leaves it
