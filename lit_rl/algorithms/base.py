"""What every algorithm shares, as one thin base class and plain functions.

The base owns the policy (loaded in `configure_model`, so strategies that shard can build it in place), the
tokenizer, the optimizer, and the rule for logging a MetricCollection once per optimizer step.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torchmetrics import MetricCollection

from lit_rl.config import OptimArgs, PolicyArgs, as_args, grouped_hparams, plain_data
from lit_rl.errors import ConfigError
from lit_rl.modeling.completions import completion_scores
from lit_rl.modeling.head import TokenScores
from lit_rl.modeling.lora import (
    LoRAConfig,
    adapter_layers,
    apply_lora,
    reference_view,
    reset_adapter,
    trainable_keys,
)
from lit_rl.modeling.models import load_causal_lm, load_tokenizer
from lit_rl.modeling.prompts import PromptEncoder
from lit_rl.numerics import settle_cpu_math_kernels
from lit_rl.resume import say
from lit_rl.resume_config import announce, reconcile, refuse_ungrouped_hyperparameters
from lit_rl.training.compat import mark_step_saved
from lit_rl.training.flops import ModelShape, RunThroughput, device_peak, precision_advice, row_tokens_and_keys
from lit_rl.training.gradients import clip_gradients
from lit_rl.training.metrics import compute_collection
from lit_rl.training.perf import BusyClock, StepTimer, step_perf
from lit_rl.training.strategies import gathered_parameters, hf_zero3_loading, shards_parameters


class PolicyModule(L.LightningModule):
    """Base of the algorithms: a causal-LM policy, its tokenizer, AdamW with linear warm-up."""

    # RL algorithms compare log-probs of the same tokens under the same weights: no dropout (SFT keeps it).
    disable_dropout = True

    def __init__(
        self,
        policy: Optional[PolicyArgs] = None,
        optim: Optional[OptimArgs] = None,
        random_init: bool = False,
        max_prompt_length: Optional[int] = None,
    ) -> None:
        """`policy` and `optim`: the groups of `lit_rl.config` (None: their defaults); `random_init`: a random
        model of the checkpoint's config instead of its weights; `max_prompt_length`: prompts keep their last
        that many tokens (None: no limit)."""
        super().__init__()
        self.policy_args = policy = as_args(PolicyArgs, policy)
        self.optim_args = optim = as_args(OptimArgs, optim)
        policy.check()
        optim.check()
        lora = policy.lora
        if lora is not None and random_init:
            raise ConfigError(
                "model.policy.lora with model.random_init: the adapter would train on random frozen weights that no "
                "checkpoint keeps; train the full model (drop model.policy.lora) or start from saved weights"
            )
        if lora is not None and lora.dropout > 0 and self.disable_dropout:
            raise ConfigError(
                f"model.policy.lora.dropout must be 0 for {type(self).__name__} (got {lora.dropout}): it compares "
                "log-probs of the same tokens under the same weights, which dropout would make differ"
            )
        settle_cpu_math_kernels()  # a module built outside the CLI: before its math runs threaded (lit_rl/numerics.py)
        self.random_init = random_init
        self.tokenizer = load_tokenizer(policy.model_name_or_path, trust_remote_code=policy.trust_remote_code)
        self.prompt_encoder = PromptEncoder(self.tokenizer, max_prompt_length)  # the prompts as the policy reads them
        self.policy: Optional[torch.nn.Module] = None
        self.ref_model: Optional[torch.nn.Module] = None  # frozen; set by `load_reference`, never checkpointed
        # One engine clock for the module's life (`perf/engine_busy_s`), given to every step timer.
        self.engine_clock = BusyClock()
        self.timer = StepTimer(self.engine_clock)  # perf/ metrics: where each step's time goes
        self._timer_during_training: Optional[StepTimer] = None  # set aside while validation runs
        # Model FLOPs (`lit_rl.training.flops`): the policy's shape, taken whole before a strategy shards it.
        self.policy_shape: Optional[ModelShape] = None
        self.throughput = RunThroughput()  # the run's totals, for the end-of-run summary

    @property
    def padding_free(self) -> bool:
        """Training forwards on packed rows (`lit_rl.modeling.packing`)."""
        return self.policy_args.padding_free

    @property
    def head_chunk_tokens(self) -> Optional[int]:
        """The output head on chunks of this many tokens (`lit_rl.modeling.head`); None: all at once."""
        return self.policy_args.head_chunk_tokens

    # -- model -----------------------------------------------------------------------------------------------
    def load_model(self, random_init: bool = False, path: Optional[str] = None) -> torch.nn.Module:
        """The policy's model (or the one at `path`, e.g. a reference) with this module's loading options."""
        args = self.policy_args
        model = load_causal_lm(
            path or args.model_name_or_path,
            dtype=args.dtype,
            random_init=random_init,
            gradient_checkpointing=args.gradient_checkpointing,
            trust_remote_code=args.trust_remote_code,
            attn_implementation=args.attn_implementation,
            disable_dropout=self.disable_dropout,
        )
        if len(self.tokenizer) > model.get_input_embeddings().num_embeddings:  # a pad token was added
            model.resize_token_embeddings(len(self.tokenizer))
        return model

    @property
    def lora_config(self) -> Optional[LoRAConfig]:
        """`model.policy.lora`: train a LoRA adapter instead of the full weights (None: full fine-tuning)."""
        return self.policy_args.lora

    def reference_is_adapter_off(self, path: Optional[str] = None) -> bool:
        """Whether the reference (the model at `path`, default the starting policy) is the policy with its LoRA
        adapter disabled, so that no second copy of the weights is loaded. Raises when training biases (which
        disabling the adapter does not undo) would make that reference differ from the starting model."""
        lora = self.lora_config
        adapter_off = lora is not None and path in (None, self.policy_args.model_name_or_path)
        if adapter_off and lora.bias != "none":
            raise ConfigError(
                f"model.policy.lora.bias={lora.bias!r} trains biases, which disabling the adapter does not undo: the "
                "reference model would drift from the starting policy (use bias: none)"
            )
        return adapter_off

    @contextmanager
    def reference_model(self) -> Iterator[torch.nn.Module]:
        """The model that gives reference log-probs: the frozen copy, or with LoRA the policy, adapter disabled."""
        if self.ref_model is not None:
            yield self.ref_model
        elif self.reference_is_adapter_off():
            with reference_view(self.policy):
                yield self.policy
        else:
            raise RuntimeError("no reference model was loaded")

    def load_reference(self, path: Optional[str] = None) -> torch.nn.Module:
        """A frozen copy of the model at `path` (default: the starting policy), in eval mode (under ZeRO-3 it is
        partitioned like the policy and never given to the optimizer)."""
        with hf_zero3_loading(self.attached_strategy()):
            return self.load_model(path=path).eval().requires_grad_(False)

    def attached_strategy(self) -> Optional[Any]:
        """The trainer's strategy, or None for a module used on its own (tests, export)."""
        return self._trainer.strategy if self._trainer is not None else None

    def configure_model(self) -> None:
        if self.head_chunk_tokens is not None and isinstance(self.attached_strategy(), FSDPStrategy):
            raise ConfigError(
                "model.policy.head_chunk_tokens is not supported with FSDP yet (the head runs outside the wrapped "
                "model's forward, which FSDP must unshard); use DeepSpeed ZeRO-3 or drop the option"
            )
        if self.policy is None:
            # from_pretrained returns eval mode; Lightning switches modes around validation, start in train mode.
            with hf_zero3_loading(self.attached_strategy()):
                self.policy = self.load_model(random_init=self.random_init).train()
                if self.lora_config is not None:
                    self._add_lora_adapter()
        if self.policy_shape is None:
            self.policy_shape = ModelShape.of(self.policy)
        if self.policy_args.compile:
            self._compile_policy()

    def _compile_policy(self) -> None:
        """`model.policy.compile`: every call of the policy runs through `torch.compile` (in place, so parameter
        names, checkpoints and the weights engines are given stay the same)."""
        if self.parameters_sharded():
            raise ConfigError(
                "model.policy.compile=true needs each rank to hold whole weights; this strategy shards them "
                "(ZeRO-3, FSDP): use DDP or ZeRO-2, or leave compile off"
            )
        self.policy.compile()

    def _add_lora_adapter(self) -> None:
        """Wrap the policy with a new LoRA adapter, initialised from the run's seed alone: the same under every
        strategy, and leaving the global RNG stream (which validation sampling draws from) where it was."""
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            self.policy = apply_lora(self.policy, self.lora_config)
            torch.manual_seed(torch.initial_seed())
            for layer in adapter_layers(self.policy):
                # Under ZeRO-3 `configure_model` runs inside `deepspeed.zero.Init`: the adapters were partitioned
                # as they were created, before peft could set B = 0. Initialise them whole (elsewhere a no-op).
                with gathered_parameters(layer, modifier_rank=0):
                    reset_adapter(layer)

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

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved_policy = grouped_hparams(checkpoint.get("hyper_parameters") or {}).get("policy") or {}
        saved_lora = saved_policy.get("lora") is not None
        if saved_lora != (self.lora_config is not None):
            raise ConfigError(
                f"the checkpoint was trained {'with' if saved_lora else 'without'} model.policy.lora and this run is "
                f"{'not' if saved_lora else 'configured with it'}: resume with the checkpoint's model.policy.lora"
            )
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
        subcommand = {TrainerFn.FITTING: "fit", TrainerFn.VALIDATING: "validate", TrainerFn.TESTING: "test"}
        changed = reconcile(
            subcommand.get(self.trainer.state.fn, "predict"),
            type(self),
            self.hparams,
            checkpoint["hyper_parameters"],
            self.trainer.ckpt_path,
        )
        for difference in changed:
            say(announce(difference))

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

    def on_train_start(self) -> None:
        if self.trainer.ckpt_path:
            self.apply_configured_rates()
        dtype = self.compute_dtype()
        self.throughput = RunThroughput(peak=device_peak(self.device, dtype), devices=self.trainer.world_size)
        advice = precision_advice(self.device, dtype) if self.trainer.is_global_zero else None
        if advice:
            say(advice)
        self.start_step_clock()
        # Lightning's ModelCheckpoint forgets, on resume, that the resumed-from step was saved; with gradient
        # accumulation the first micro-batches after resuming end with the old global_step, and it would save
        # that step again (with a data position one micro-batch later). Mark the resumed step as saved.
        for callback in self.trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint):
                mark_step_saved(callback, self.trainer.global_step)

    def step_loss_scale(self, accumulated: bool = True, across_ranks: bool = True) -> float:
        """What a micro-batch loss normalised over the whole optimizer step (all micro-batches and ranks) is
        multiplied by, so the gradient Lightning and the strategy produce is exactly that loss's gradient.

        Lightning divides each micro-batch loss by the accumulation; data-parallel strategies average gradients
        over ranks; DeepSpeed's engine divides by its accumulation steps once more. `accumulated=False` for a loss
        whose denominator does not span the accumulation window, `across_ranks=False` for one that does not span
        the ranks (a per-micro-batch mean: then only DeepSpeed's second division is undone).
        """
        accumulate = self.trainer.accumulate_grad_batches
        scale = float(self.trainer.world_size if across_ranks else 1) * (accumulate if accumulated else 1)
        if self.trainer.strategy.handles_gradient_accumulation:  # DeepSpeed
            scale *= accumulate
        return scale

    def score_completions(
        self,
        model: torch.nn.Module,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        completion_ids: torch.Tensor,
        completion_mask: torch.Tensor,
        temperature: float = 1.0,
        extras: tuple[str, ...] = (),
    ) -> TokenScores:
        """`completion_scores` with this run's forward settings (sharding, padding-free, head chunks). Its model
        FLOPs count into the step's (`lit_rl.training.flops`), the backward's too when the policy's gradient is
        recorded."""
        self.count_flops(
            prompt_ids, prompt_mask, completion_mask, backward=model is self.policy and torch.is_grad_enabled()
        )
        return completion_scores(
            model,
            prompt_ids,
            prompt_mask,
            completion_ids,
            completion_mask,
            temperature,
            synced_ranks=self.parameters_sharded(),
            padding_free=self.padding_free,
            head_chunk_tokens=self.head_chunk_tokens,
            extras=extras,
        )

    def optimizer_param_groups(self) -> list[dict[str, Any]]:
        """AdamW's parameter groups: the policy's trainable parameters (at `learning_rate`); PPO adds its critic's
        at their own rate. The warm-up scales every group alike."""
        return [{"params": [p for p in self.policy.parameters() if p.requires_grad]}]

    def configure_optimizers(self) -> dict[str, Any]:
        optim = self.optim_args
        groups = self.optimizer_param_groups()
        params = [p for group in groups for p in group["params"]]
        # torch's fused AdamW kernel (CPU and CUDA): one pass over the parameters instead of a loop of small ops,
        # about 10x faster on the 21M benchmark model (0.009 s vs 0.092 s per step on 2 CPU cores). Not with fp16
        # mixed precision: the gradient scaler must unscale before clipping, which a fused step does internally.
        fp16_scaled = self._trainer is not None and str(self._trainer.precision) == "16-mixed"
        fused = all(p.device.type in ("cpu", "cuda") for p in params) and not fp16_scaled
        optimizer = torch.optim.AdamW(groups, lr=optim.learning_rate, weight_decay=optim.weight_decay, fused=fused)
        warmup = max(optim.warmup_steps, 0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / (warmup + 1)))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def compute_dtype(self) -> torch.dtype:
        """The dtype the policy's forward computes in: `trainer.precision`'s (bf16-mixed and bf16-true: bfloat16;
        16-mixed and 16-true: float16), else the policy's parameter dtype."""
        precision = str(self._trainer.precision) if self._trainer is not None else ""
        if precision.startswith("bf16"):
            return torch.bfloat16
        if precision.startswith("16"):
            return torch.float16
        return next(self.policy.parameters()).dtype

    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, gradient_clip_val=None, gradient_clip_algorithm=None
    ) -> None:
        clip_gradients(self, optimizer, gradient_clip_val, gradient_clip_algorithm)  # lit_rl.training.gradients

    def parameters_sharded(self) -> bool:
        """Whether every forward gathers the parameters from all ranks (ZeRO-3, FSDP on several ranks): then all
        ranks must run the same forwards."""
        trainer = self._trainer
        return trainer is not None and trainer.world_size > 1 and shards_parameters(trainer.strategy)

    # -- text ------------------------------------------------------------------------------------------------
    # -- metrics ---------------------------------------------------------------------------------------------
    def log_collection(self, collection: MetricCollection, on_step: bool, prog_bar: tuple[str, ...] = ()) -> None:
        """Compute (synced across ranks), log and reset every metric of `collection` that received data on any rank."""
        values = {f"{collection.prefix}{name}": value for name, value in compute_collection(collection).items()}
        collection.reset()
        for name, value in values.items():
            shown = any(name.endswith("/" + key) and name.count("/") == 1 for key in prog_bar)
            self.log(name, value, on_step=on_step, on_epoch=not on_step, prog_bar=shown, batch_size=1)
        if not on_step and values and self.trainer.state.fn == TrainerFn.FITTING:
            # Validation inside fit: label it with the number of optimizer steps taken so far.
            self.log("step", float(self.trainer.global_step), on_step=False, on_epoch=True, batch_size=1)
        if on_step and values:
            # Called just before optimizer step number `global_step + 1`: label the row with that number, the
            # one its checkpoint (`step=<N>.ckpt`) carries, instead of Lightning's 0-based batch counter.
            self.log("step", float(self.trainer.global_step + 1), on_step=True, on_epoch=False, batch_size=1)

    # -- timings ---------------------------------------------------------------------------------------------
    def count_flops(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        completion_mask: torch.Tensor,
        backward: bool = False,
        shape: Optional[ModelShape] = None,
    ) -> None:
        """Add a forward (and `backward`) of these rows by the policy's architecture (or `shape`'s) to the step's
        model FLOPs."""
        shape = shape or self.policy_shape
        if shape is None:  # a module used outside `fit` (tests, export)
            return
        tokens, keys = row_tokens_and_keys(prompt_ids, prompt_mask, completion_mask)
        flops = shape.forward_flops(tokens, keys) + (shape.backward_flops(tokens, keys) if backward else 0.0)
        self.timer.count("model_flops", flops)
        if backward:  # a training pass: its forward and backward are the policy update's work
            self.timer.count("update_flops", flops)

    def log_timings(self) -> None:
        """Log the step's `perf/` metrics (`lit_rl.training.perf.step_perf`; call once per optimizer step)."""
        gather = self.all_gather if self.trainer.world_size > 1 else None
        for name, value in step_perf(self.timer, self.throughput, gather, self.device).items():
            self.log(name, value, on_step=True, on_epoch=False, batch_size=1)

    def start_step_clock(self) -> None:
        """The first step's time starts now (at the start of training: not at model loading, nor the peak's probe);
        an engine built before, in the sanity check's validation, goes on counting on the module's clock."""
        self.timer = StepTimer(self.engine_clock)

    def on_validation_start(self) -> None:
        self._timer_during_training = self.timer
        self._timer_during_training.pause()  # validation's time and work are not part of any training step
        self.timer = StepTimer(self.engine_clock)

    def on_validation_end(self) -> None:
        if self._timer_during_training is not None:
            self.timer = self._timer_during_training
        self.timer.resume()
