"""Each private internal lit-rl touches (`lit_rl.training.compat`), run against the installed Lightning, torch,
torchmetrics, transformers and Python: an upgrade that renames or changes one fails here, by name, not as a silent
change of behaviour deep in a run."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from typing import Optional

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_rl.config import RewardArgs
from lit_rl.training import compat


def _trainer(**kwargs) -> L.Trainer:
    kwargs = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False, **kwargs}
    return L.Trainer(accelerator="cpu", enable_model_summary=False, **kwargs)


def test_a_checkpoint_callback_is_told_what_was_saved(tmp_path):
    callback = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2)
    compat.mark_step_saved(callback, 4)
    compat.mark_step_saved(callback, 2)  # never backwards
    assert callback._last_global_step_saved == 4
    compat.mark_last_written(callback, str(tmp_path / "last.ckpt"), 6)
    assert callback._last_checkpoint_saved == str(tmp_path / "last.ckpt") and callback._last_global_step_saved == 6
    # The two states are what ModelCheckpoint reads when it decides whether to save (it would rename them with it).
    source = inspect.getsource(ModelCheckpoint)
    assert "self._last_global_step_saved" in source and "self._last_checkpoint_saved" in source


def test_the_fit_loop_says_which_batches_accumulate_and_a_validation_can_be_skipped():
    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)
            self.seen: list[bool] = []

        def training_step(self, batch, batch_idx):
            self.seen.append(compat.accumulates_this_batch(self.trainer))
            return self.layer(batch).sum()

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.randn(6, 2), batch_size=1)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = Module()
    _trainer(max_steps=3, accumulate_grad_batches=2).fit(module)
    assert module.seen == [True, False] * 3  # the first micro-batch of each window of 2 accumulates
    trainer = _trainer()
    compat.skip_next_validation(trainer)
    assert trainer.fit_loop.epoch_loop._skip_next_val is True
    assert "self._skip_next_val" in inspect.getsource(type(trainer.fit_loop.epoch_loop))  # still read there


# Lightning's private methods lit-rl overrides: renamed upstream, an override would silently never run.
OVERRIDES = {
    ("LightningCLI", "_parse_ckpt_path"),  # lit_rl.cli: --ckpt_path last, resolved
    ("LightningCLI", "_instantiate_trainer"),  # lit_rl.cli: lit-rl's callbacks
    ("RichProgressBar", "_get_train_description"),  # lit_rl.callbacks.progress
    ("DeepSpeedStrategy", "_auto_select_batch_size"),  # lit_rl.training.strategies: DPO's and SFT's loaders
}
SCANNED = ("lit_rl.cli", "lit_rl.loggers", "lit_rl.callbacks", "lit_rl.algorithms", "lit_rl.data", "lit_rl.training")


def _private_overrides() -> list[tuple[type, str]]:
    """Lightning's private methods that lit-rl's classes override (a `_name` defined both in a lit-rl class and in a
    Lightning class it derives from), in every module of `SCANNED`."""
    names = []
    for name in SCANNED:
        module = importlib.import_module(name)
        names.append(name)
        if hasattr(module, "__path__"):
            names += [info.name for info in pkgutil.iter_modules(module.__path__, f"{name}.")]
    found = []
    for module in map(importlib.import_module, names):
        for cls in vars(module).values():
            if not (isinstance(cls, type) and cls.__module__ == module.__name__):
                continue
            lightning_bases = [base for base in cls.__mro__[1:] if base.__module__.startswith("lightning")]
            for name, value in vars(cls).items():
                if name.startswith("_") and not name.startswith("__") and inspect.isfunction(value):
                    base = next((base for base in lightning_bases if name in vars(base)), None)
                    if base is not None:
                        found.append((base, name))
    return found


def test_the_private_overrides_are_the_ones_lit_rl_knows_of():
    """Found by search, so that a method Lightning renames (the override then overrides nothing, and the search
    loses it) or a new override (not yet checked below) fails here."""
    assert {(base.__name__, name) for base, name in _private_overrides()} == OVERRIDES


@pytest.mark.parametrize("base,name", _private_overrides(), ids=lambda value: getattr(value, "__name__", value))
def test_the_private_methods_lit_rl_overrides_are_still_called_by_lightning(base, name):
    assert callable(getattr(base, name, None)), f"{base.__name__}.{name} is gone: lit-rl's override never runs"
    callers = "".join(inspect.getsource(cls) for cls in base.__mro__ if cls.__module__.startswith("lightning"))
    assert f"self.{name}(" in callers, f"Lightning no longer calls {base.__name__}.{name}"


def test_a_lightning_module_reports_the_device_its_tensors_were_moved_to_by_hand():
    module = L.LightningModule()
    assert module.device == torch.device("cpu")
    compat.set_module_device(module, torch.device("meta"))
    assert module.device == torch.device("meta")
    compat.set_module_device(torch.nn.Linear(1, 1), torch.device("meta"))  # a plain module has no such state


def test_torch_internals():
    tensors = [torch.tensor([3.0, 4.0]), torch.tensor([[1.0, float("nan")]], dtype=torch.bfloat16)]
    norms = compat.foreach_norm(tensors, dtype=torch.float32)
    assert norms[0].item() == 5.0 and norms[0].dtype == torch.float32 and norms[1].isnan()
    module = torch.nn.BatchNorm1d(2)
    module.register_buffer("scratch", torch.zeros(1), persistent=False)
    module.register_buffer("unset", None)
    names = [name for name, _ in compat.persistent_buffers(module)]
    assert names == ["running_mean", "running_var", "num_batches_tracked"]
    assert set(names) == {key for key in module.state_dict() if key not in ("weight", "bias")}
    counted = torch.zeros(3)
    before = compat.version_counter(counted)
    counted[1:].add_(1.0)  # through a view: the storage's counter moves
    assert compat.version_counter(counted) > before
    param = torch.nn.Parameter(torch.ones(2))
    assert compat.can_take_data_of(param, torch.zeros(2, dtype=torch.float64))
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    assert callable(ProcessGroupGloo._set_sequence_number_for_group)  # run for real in tests/test_security.py


def test_torchmetrics_states_and_their_reductions():
    from torchmetrics import MaxMetric, MeanMetric
    from torchmetrics.utilities.data import dim_zero_max, dim_zero_sum

    assert compat.state_reductions(MeanMetric()) == {"mean_value": dim_zero_sum, "weight": dim_zero_sum}
    assert compat.state_reductions(MaxMetric()) == {"max_value": dim_zero_max}


def test_the_attention_kernel_of_a_hugging_face_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    for kernel in ("eager", "sdpa"):
        config._attn_implementation = kernel
        assert compat.attention_implementation(Qwen2ForCausalLM(config)) == kernel
    assert compat.attention_implementation(torch.nn.Linear(1, 1)) == ""


def test_a_flash_kernel_counts_as_installed_only_with_its_package():
    import importlib.util

    assert compat.flash_attention_installed("flash_attention_2") == (importlib.util.find_spec("flash_attn") is not None)
    assert not compat.flash_attention_installed("flash_attention_9")  # a version transformers does not know


def test_null_reaches_a_nested_option_of_a_class_given_by_class_path():
    from jsonargparse import ArgumentParser

    from lit_rl.training.compat import keep_nested_nulls

    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(_WithRewards, "module")
    args = ["--module", f"{__name__}._WithRewards", "--module.rewards.weights", "[2.0]"]
    keep_nested_nulls()
    keep_nested_nulls()  # idempotent
    assert parser.parse_args(args).module.init_args.rewards.weights == [2.0]
    parsed = parser.parse_args([*args, "--module.rewards.weights", "null", "--module.beta", "null"])
    assert parsed.module.init_args.rewards.weights is None and parsed.module.init_args.beta is None
    assert isinstance(parser.instantiate_classes(parsed).module.rewards, RewardArgs)


class _WithRewards:
    def __init__(self, rewards: Optional[RewardArgs] = None, beta: Optional[float] = 0.1):
        self.rewards = rewards
