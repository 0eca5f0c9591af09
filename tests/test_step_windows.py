"""The offline loaders (SFT, DPO) tell each batch which rows share its optimizer step, for losses normalised by the
whole step. These tests hold them to what Lightning actually groups: across epochs, `limit_train_batches` that
the accumulation does not divide, a `GradientAccumulationScheduler`, and resumes."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import pytest
import torch
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler
from torch.utils.data import DataLoader, IterableDataset

from lit_rl.algorithms import SFT
from lit_rl.data.modules import SFTDataModule
from lit_rl.data.sharding import ShardedTrainBatches, StepWindows, lightning_windows
from lit_rl.errors import ConfigError
from tests.conftest import grouped_kwargs, quiet_trainer


def test_windows_end_with_each_epoch():
    windows = StepWindows(epoch_batches=5, accumulate=2)
    assert [list(windows.window(p)) for p in range(10)] == [
        [0, 1], [0, 1], [2, 3], [2, 3], [4],  # the epoch's last step is one batch
        [5, 6], [5, 6], [7, 8], [7, 8], [9],
    ]  # fmt: skip
    assert windows.epoch_end(7) == 10


def test_a_resumed_loader_gives_the_same_batches_and_windows_as_an_uninterrupted_one():
    rows = [{"prompt": str(i), "completion": str(i)} for i in range(11)]
    windows = lambda: StepWindows(4, 3)  # noqa: E731  (limit 4 of the 6 batches, accumulate 3)
    position = {"n": 0}
    loader = ShardedTrainBatches(rows, 2, 7, 0, 1, start_batch=lambda: position["n"], windows=windows)
    straight = []
    for _ in range(3):  # three epochs of 4 batches: the data's passes (6 batches) carry over epoch ends
        for batch in loader:
            straight.append(batch)
            position["n"] += 1
    assert len(straight) == 12
    position["n"] = 5  # resumed inside the second epoch
    resumed = list(loader)
    plain = lambda batches: [(b["rows"], b["weight"].tolist(), b["window_rows"]) for b in batches]  # noqa: E731
    assert plain(resumed) == plain(straight[5:8])
    # The window of positions 4-6 spans two passes over the data (batch 5 holds the 11th row alone), then 1 batch.
    assert [len(b["window_rows"]) for b in straight[4:8]] == [5, 5, 5, 2]


def test_deepspeed_refuses_an_epoch_that_is_not_whole_optimizer_steps():
    trainer = SimpleNamespace(
        num_training_batches=5, accumulate_grad_batches=2, strategy=SimpleNamespace(handles_gradient_accumulation=True)
    )
    with pytest.raises(ConfigError, match=r"trainer\.accumulate_grad_batches=2 does not divide the 5 training"):
        lightning_windows(trainer, 10)
    trainer.num_training_batches = 4
    assert lightning_windows(trainer, 10) == StepWindows(4, 2)
    trainer.num_training_batches = float("inf")  # a loader without a length: the data's batches
    assert lightning_windows(trainer, 10) == StepWindows(10, 2)


class StepRows(Callback):
    """Per batch: the optimizer step it trains in (Lightning's count), its rows, and the rows it says its step has."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, list[str], list[str]]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        real = [row["prompt"] for row, weight in zip(batch["rows"], batch["weight"].tolist()) if weight > 0]
        self.batches.append((trainer.global_step, real, sorted(row["prompt"] for row in batch["window_rows"])))


def _fit(callbacks, **trainer_args) -> StepRows:
    torch.manual_seed(0)
    module = SFT(**grouped_kwargs(SFT, model_name_or_path="lit-rl/tiny-qwen2-base", random_init=True))
    data = SFTDataModule(val_data=None, batch_size=3)
    recorder = StepRows()
    trainer = quiet_trainer(callbacks=[recorder, *callbacks], **trainer_args)
    trainer.fit(module, data)
    return recorder


def test_each_batch_carries_the_rows_of_the_optimizer_step_lightning_trains_it_in():
    """limit 5 batches an epoch; accumulation 2 in epochs 0-1 (steps of 2, 2, 1 batches), 3 from epoch 2 (3, 2)."""
    recorder = _fit([GradientAccumulationScheduler({0: 2, 2: 3})], limit_train_batches=5, max_steps=8)
    steps: dict[int, list[str]] = {}
    for step, rows, _ in recorder.batches:
        steps.setdefault(step, []).extend(rows)
    assert [sum(1 for s, _, _ in recorder.batches if s == step) for step in sorted(steps)] == [2, 2, 1] * 2 + [3, 2]
    for step, _, window in recorder.batches:
        assert window == sorted(steps[step]), step


class WithoutWindowRows(IterableDataset):
    def __init__(self, batches) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        return ({k: v for k, v in batch.items() if k != "window_rows"} for batch in self.batches)


class RowsOnly(SFTDataModule):
    """A user's data module whose batches do not say their step's rows."""

    def train_dataloader(self):
        return DataLoader(WithoutWindowRows(super().train_dataloader().dataset), batch_size=None)


def _trained(data: SFTDataModule, start: Optional[dict] = None, **trainer_args) -> dict[str, torch.Tensor]:
    """The weights after 2 steps (and the ones before, into `start` when given)."""
    torch.manual_seed(0)
    module = SFT(**grouped_kwargs(SFT, model_name_or_path="lit-rl/tiny-qwen2-base", random_init=True))
    if start is not None:
        module.configure_model()
        start.update({name: value.clone() for name, value in module.policy.state_dict().items()})
    trainer = quiet_trainer(max_steps=2, **trainer_args)
    trainer.fit(module, data)
    return {name: value.clone() for name, value in module.policy.state_dict().items()}


def test_sft_trains_on_batches_without_window_rows_exactly_without_accumulation_and_says_so_with_it():
    expected = _trained(SFTDataModule(val_data=None, batch_size=3))
    got = _trained(RowsOnly(val_data=None, batch_size=3))
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-7, msg=name)
    with pytest.warns(UserWarning, match="SFT: the training batches carry no `window_rows`"):
        _trained(RowsOnly(val_data=None, batch_size=3), accumulate_grad_batches=2)


def test_a_0_1_config_with_data_num_workers_still_loads_and_is_told_the_key_is_ignored():
    with pytest.warns(UserWarning, match=r"data\.num_workers=2 is ignored since lit-rl 0\.2"):
        SFTDataModule(num_workers=2)


def test_a_token_budget_regroups_each_steps_items_and_keeps_them():
    rows = [{"prompt": str(i), "completion": str(i)} for i in range(40)]
    tokens = [(7 * i) % 23 + 3 for i in range(40)]  # 3 to 25 tokens
    windows = lambda: StepWindows(10, 4)  # noqa: E731  (10 batches of 4 items, steps of 4, 4 and 2 batches)
    plain = ShardedTrainBatches(rows, 4, 1, 0, 1, windows=windows)
    budget = ShardedTrainBatches(rows, 4, 1, 0, 1, windows=windows, micro_batch_tokens=80, item_tokens=tokens)
    for start, size in ((0, 4), (4, 4), (8, 2)):
        steps = range(start, start + size)
        want = sorted(i for p in steps for i in plain.batch_at(p)[0])
        got = [budget.micro_batch_at(p, windows()) for p in steps]
        real = [[i for i, w in zip(indices, weights) if w > 0] for indices, weights in got]
        assert sorted(i for group in real for i in group) == want  # the step's items, each once
        loads = [sum(tokens[i] for i in group) for group in real]
        assert max(loads) <= 80 and len(got) == size, loads
    # A step whose items fit in fewer micro-batches runs the rest on one item of weight 0.
    assert any(weights == [0.0] for p in range(10) for _, weights in [budget.micro_batch_at(p, windows())])


class LargestMicroBatch(Callback):
    """Each optimizer step's logged `train/micro_batch_tokens/max` (None when not logged) and, counted here from the
    data as the token budget counts it (`item_tokens`), the real tokens of the step's largest micro-batch."""

    def __init__(self, item_tokens) -> None:
        self.item_tokens = item_tokens  # (module, batch) -> the micro-batch's real tokens
        self.logged: list[Optional[float]] = []
        self.counted: list[int] = []
        self._step: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._step.append(self.item_tokens(trainer, pl_module, batch))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        metrics = pl_module.train_metrics
        logged = metrics["micro_batch_tokens/max"].compute() if "micro_batch_tokens/max" in metrics else None
        self.logged.append(None if logged is None else float(logged))
        self.counted.append(max(self._step))
        self._step = []


def dpo_pair_tokens(trainer, module, batch) -> int:
    pairs = trainer.datamodule.train_pairs
    return sum(pairs[i].num_tokens for i, w in zip(batch["index"].tolist(), batch["weight"].tolist()) if w)


def sft_row_tokens(trainer, module, batch) -> int:
    return sum(module.row_tokens([row for row, w in zip(batch["rows"], batch["weight"].tolist()) if w]))


def _dpo_weights(**data_args) -> tuple[list[float], dict[str, torch.Tensor], dict, LargestMicroBatch]:
    from lit_rl.algorithms import DPO
    from lit_rl.data.modules import PreferenceDataModule

    torch.manual_seed(0)
    module = DPO(**grouped_kwargs(DPO, learning_rate=1e-3))
    module.configure_model()
    start = {name: value.clone() for name, value in module.policy.state_dict().items()}
    losses = []

    class Losses(Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            losses.append(float(pl_module.train_metrics["loss"].compute()))

    largest = LargestMicroBatch(dpo_pair_tokens)
    trainer = quiet_trainer(max_steps=3, accumulate_grad_batches=4, callbacks=[Losses(), largest])
    trainer.fit(module, PreferenceDataModule(val_data=None, batch_size=4, **data_args))
    return losses, start, {name: value.clone() for name, value in module.policy.state_dict().items()}, largest


def test_dpo_with_a_token_budget_trains_the_same_steps_and_logs_its_largest_micro_batch():
    """The same pairs per step, grouped by tokens: the same losses, and weights as `lit-rl check` compares them
    (relative to the update; Adam gives rounding-noise gradients full-size steps). With the budget,
    `train/micro_batch_tokens/max` is the step's largest micro-batch, within the budget."""
    from lit_rl.check.compare import FP32, compare_parameters

    losses, start, weights, plain = _dpo_weights()
    budget_losses, _, budget_weights, budget = _dpo_weights(micro_batch_tokens=150)
    assert budget_losses == pytest.approx(losses, rel=1e-5)
    difference, problems = compare_parameters(budget_weights, weights, start, FP32)
    assert difference.passed and not problems, difference
    assert plain.logged == [None] * 3  # no budget, no metric
    assert budget.logged == budget.counted and all(0 < tokens <= 150 for tokens in budget.counted), budget.counted


def test_sft_with_a_token_budget_trains_the_same_steps_and_logs_its_largest_micro_batch():
    from lit_rl.check.compare import FP32, compare_parameters

    start: dict = {}
    plain = _trained(SFTDataModule(val_data=None, batch_size=4), start, accumulate_grad_batches=3)
    largest = LargestMicroBatch(sft_row_tokens)
    data = SFTDataModule(val_data=None, batch_size=4, micro_batch_tokens=120)
    budget = _trained(data, accumulate_grad_batches=3, callbacks=[largest])
    difference, problems = compare_parameters(budget, plain, start, FP32)
    assert difference.passed and not problems, difference
    assert largest.logged == largest.counted and all(0 < tokens <= 120 for tokens in largest.counted), largest.counted
