"""What a checkpoint of a `PolicyModule` (`lit_rl.algorithms.base`) keeps, and what resuming from one restores or
refuses: frozen weights stay out of it, option groups are kept as plain data, the saved configuration is compared
with this run's (`lit_rl.resume_config`), and the configured learning rates and the checkpoint cadence continue."""

from __future__ import annotations

from typing import Any, Optional

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn

from lit_rl.config import OptimArgs, grouped_hparams, plain_data
from lit_rl.data.contracts import OrderedData
from lit_rl.errors import ConfigError
from lit_rl.modeling.lora import trainable_keys
from lit_rl.resume import say
from lit_rl.resume_config import (
    announce,
    other_data,
    reconcile,
    refuse_moved_position,
    refuse_ungrouped_hyperparameters,
)
from lit_rl.training.compat import mark_step_saved

# The checkpoint's entry for `CheckpointState.data_layout`.
LAYOUT_KEY = "lit_rl_layout"


class CheckpointState:
    """A mixin of `PolicyModule`: the attributes below are the module's (set in its `__init__` and
    `configure_model`); also `trainer`, `_trainer`, `hparams`, `lora_config` and `optimizer_param_groups`."""

    optim_args: OptimArgs
    policy: Any
    ref_model: Any

    # Frozen weights are reloaded from their paths: the reference model and, with LoRA, the policy's base weights
    # stay out of checkpoints (which then hold the adapter only), and their current values fill their keys back in
    # when one is loaded, so strict loading still checks every trained key.
    # (DeepSpeed saves and loads the module's weights itself, frozen ones included: its checkpoints reach these
    # hooks without a "state_dict".)
    def _frozen_state(self) -> dict[str, torch.Tensor]:
        state = {}
        if self.ref_model is not None:
            state.update({f"ref_model.{k}": v for k, v in self.ref_model.state_dict().items()})
        if self.lora_config is not None:
            trained = trainable_keys(self.policy)
            state.update({f"policy.{k}": v for k, v in self.policy.state_dict().items() if k not in trained})
        return state

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # A module built in Python (not by the CLI) holds its option groups as dataclasses: the checkpoint keeps
        # them as plain data, which export and resume read with `weights_only` loading.
        hparams = checkpoint.get("hyper_parameters")
        if hparams:
            checkpoint["hyper_parameters"] = {key: plain_data(value) for key, value in hparams.items()}
        if "state_dict" in checkpoint:
            frozen = self._frozen_state()
            checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k not in frozen}
        if self._trainer is not None:
            checkpoint[LAYOUT_KEY] = self.data_layout(self.trainer, self.trainer.datamodule)

    def data_layout(self, trainer: Any, datamodule: Any) -> dict[str, Any]:
        """The settings the checkpoint's place in the data is counted in, by the option that sets each: a resumed
        fit must keep them (`lit_rl.resume_config.refuse_moved_position`). The ranks and the accumulation of
        `trainer`; `datamodule`'s data and seed, which its order comes from; an algorithm adds its batch size (the
        on-policy ones compare theirs, `model.schedule.micro_batch_size`, as an option; the offline ones
        `datamodule`'s). Arguments, not the module's own trainer: the CLI asks before the trainer holds the module
        (`refuse_resume_before_writing`)."""
        layout: dict[str, Any] = {
            "trainer.accumulate_grad_batches": trainer.accumulate_grad_batches,
            "trainer.devices x trainer.num_nodes": trainer.world_size,
        }
        if isinstance(datamodule, OrderedData):
            layout["data.train_data"] = str(datamodule.train_data)
            layout["data.seed"] = datamodule.seed
        return layout

    # A `validate` of a checkpoint: the step it was written at, which its rows are logged at (Lightning logs them at
    # step 0, so the rows of several checkpoints could not be told apart).
    validated_step: Optional[int] = None

    def log_validated_step(self) -> None:
        """With the validation metrics: a logged `step` is the step Lightning writes the row at. Once: a later `fit`
        or `validate` of the same module logs at its own step."""
        if self.validated_step is not None:
            self.log("step", float(self.validated_step))
            self.validated_step = None

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self._trainer is not None and self.trainer.state.fn == TrainerFn.VALIDATING:
            self.validated_step = int(checkpoint.get("global_step", 0))
        self._refuse_other_lora(checkpoint)
        if "state_dict" in checkpoint:
            for key, value in self._frozen_state().items():
                checkpoint["state_dict"].setdefault(key, value)
        self.check_resumed_hyperparameters(checkpoint)

    def check_resumed_hyperparameters(self, checkpoint: dict[str, Any]) -> None:
        """This run's configuration against the one the checkpoint was trained with (`lit_rl/resume_config.py`):
        a key that may change says so in one line, any other difference stops the run in one line."""
        saved = checkpoint.get("hyper_parameters") or {}
        if self._trainer is None:
            refuse_ungrouped_hyperparameters(self, saved)
        if self._trainer is None or not saved:
            return
        subcommands = {TrainerFn.FITTING: "fit", TrainerFn.VALIDATING: "validate", TrainerFn.TESTING: "test"}
        subcommand = subcommands.get(self.trainer.state.fn, "predict")
        ckpt_path = self.trainer.ckpt_path
        changed = reconcile(subcommand, type(self), self.hparams, checkpoint["hyper_parameters"], ckpt_path)
        if subcommand == "fit":
            layout, saved_layout = self.data_layout(self.trainer, self.trainer.datamodule), checkpoint.get(LAYOUT_KEY)
            refuse_moved_position(layout, saved_layout or {}, ckpt_path)
            changed += other_data(layout, saved_layout or {})
        for difference in changed:
            say(announce(difference))

    def refuse_resume_before_writing(
        self, trainer: Any, datamodule: Any, checkpoint: dict[str, Any], path: Any
    ) -> None:
        """The refusals of a resumed `fit` (`on_load_checkpoint`, `check_resumed_hyperparameters`), made before the
        run writes anything: Lightning loads the checkpoint after the run's `config.yaml` is written and its
        `metrics.csv` cut to the checkpoint's step, so a resume refused there had replaced both. Differences a
        resume may make are said when the checkpoint loads."""
        self._refuse_other_lora(checkpoint)
        saved = checkpoint.get("hyper_parameters") or {}
        if not saved:  # as `check_resumed_hyperparameters`: nothing to compare
            return
        reconcile("fit", type(self), self.hparams, saved, path)
        refuse_moved_position(self.data_layout(trainer, datamodule), checkpoint.get(LAYOUT_KEY) or {}, path)

    def _refuse_other_lora(self, checkpoint: dict[str, Any]) -> None:
        saved_policy = grouped_hparams(checkpoint.get("hyper_parameters") or {}).get("policy") or {}
        saved_lora = saved_policy.get("lora") is not None
        if saved_lora != (self.lora_config is not None):
            raise ConfigError(
                f"the checkpoint was trained {'with' if saved_lora else 'without'} model.policy.lora and this run is "
                f"{'not' if saved_lora else 'configured with it'}: resume with the checkpoint's model.policy.lora"
            )

    def apply_configured_rates(self) -> None:
        """After a resume: the learning rates and weight decay this run configured, in place of those the restored
        optimizer state holds (a resumed run may change them, `resume_config.MAY_CHANGE_ON_RESUME`). The warm-up
        factor reached so far is kept: lr = configured rate x the scheduler's factor at its current step."""
        configured = self.optimizer_param_groups()
        schedulers = [config.scheduler for config in self.trainer.lr_scheduler_configs]  # one optimizer: AdamW
        for optimizer in self.trainer.optimizers:
            for index, (group, wanted) in enumerate(zip(optimizer.param_groups, configured)):
                rate = wanted.get("lr", self.optim_args.learning_rate)
                for scheduler in schedulers:
                    if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
                        scheduler.base_lrs[index] = rate
                        rate = rate * scheduler.lr_lambdas[index](scheduler.last_epoch)
                group["lr"] = rate
                group["initial_lr"] = wanted.get("lr", self.optim_args.learning_rate)
                group["weight_decay"] = wanted.get("weight_decay", self.optim_args.weight_decay)

    def continue_from_checkpoint(self) -> None:
        """At the start of training: after a resume, the rates this run configured (`apply_configured_rates`);
        and the step resumed from marked saved."""
        if self.trainer.ckpt_path:
            self.apply_configured_rates()
        # Lightning's ModelCheckpoint forgets, on resume, that the resumed-from step was saved; with gradient
        # accumulation the first micro-batches after resuming end with the old global_step, and it would save
        # that step again (with a data position one micro-batch later). Mark the resumed step as saved.
        for callback in self.trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint):
                mark_step_saved(callback, self.trainer.global_step)
