"""What every algorithm shares: `PolicyModule`, split by job into three files.

- `policy_model.py` (`PolicyModel`): the policy's model and its reference: loading (in `configure_model`, so
  strategies that shard can build it in place), the LoRA adapter, `torch.compile`.
- `checkpoint_state.py` (`CheckpointState`): what a checkpoint keeps and what a resume restores or refuses.
- here: the tokenizer and prompt encoder, the optimizer, the step's loss scale, dtype and gradient clipping, the
  forward over completions with the run's settings, and the rule for logging a MetricCollection and the step's
  timings once per optimizer step.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.trainer.states import TrainerFn
from torchmetrics import Metric, MetricCollection

from lit_rl.algorithms.checkpoint_state import CheckpointState
from lit_rl.algorithms.policy_model import PolicyModel
from lit_rl.config import OptimArgs, PolicyArgs, as_args
from lit_rl.errors import ConfigError
from lit_rl.modeling.completions import completion_scores
from lit_rl.modeling.head import TokenScores
from lit_rl.modeling.models import load_tokenizer
from lit_rl.modeling.prompts import PromptEncoder
from lit_rl.numerics import settle_cpu_math_kernels
from lit_rl.resume import say
from lit_rl.training.flops import ModelShape, RunThroughput, device_peak, precision_advice, row_tokens_and_keys
from lit_rl.training.gradients import clip_gradients, refuse_float16_parameters
from lit_rl.training.metrics import compute_collection, half_precision_states
from lit_rl.training.perf import BusyClock, StepTimer, step_perf
from lit_rl.training.strategies import shards_parameters


class PolicyModule(PolicyModel, CheckpointState, L.LightningModule):
    """Base of the algorithms: a causal-LM policy (loaded by `PolicyModel`, kept in checkpoints by
    `CheckpointState`), its tokenizer, AdamW with linear warm-up, the step's loss scale, dtype and clipping, and
    the logging of metrics and timings."""

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
        self._logged_metrics: set[str] = set()  # the names `log_collection` has logged (NaN when without data)

    def _apply(self, fn: Any, recurse: bool = True) -> PolicyModule:
        """`nn.Module._apply` (under `.to`, `.cuda`, ...), with the metrics' states kept float32: `bf16-true` and
        `16-true` cast the whole module with `.to(dtype)`, which torchmetrics lets through (it guards `.half()` and
        the like only), and sums in half precision round (300 updates of 7 tokens counted 2048, not 2100)."""
        super()._apply(fn, recurse)
        for module in self.modules():
            if isinstance(module, Metric) and half_precision_states(module):  # its integer states stay as they are
                module._apply(lambda t: t.float() if t.dtype in (torch.float16, torch.bfloat16) else t)
        return self

    @property
    def padding_free(self) -> bool:
        """Training forwards on packed rows (`lit_rl.modeling.packing`)."""
        return self.policy_args.padding_free

    @property
    def head_chunk_tokens(self) -> Optional[int]:
        """The output head on chunks of this many tokens (`lit_rl.modeling.head`); None: all at once."""
        return self.policy_args.head_chunk_tokens

    def on_train_start(self) -> None:
        self.continue_from_checkpoint()
        dtype = self.compute_dtype()
        self.throughput = RunThroughput(peak=device_peak(self.device, dtype), devices=self.trainer.world_size)
        advice = precision_advice(self.device, dtype) if self.trainer.is_global_zero else None
        if advice:
            say(advice)
        self.start_step_clock()

    def step_loss_scale(self, accumulated: bool = True) -> float:
        """What a micro-batch loss normalised over the whole optimizer step (all micro-batches and ranks) is
        multiplied by, so the gradient Lightning and the strategy produce is exactly that loss's gradient.

        Lightning divides each micro-batch loss by the accumulation; data-parallel strategies average gradients
        over ranks; DeepSpeed's engine divides by its accumulation steps once more. `accumulated=False` for a loss
        whose denominator spans the ranks but not the accumulation window.
        """
        accumulate = self.trainer.accumulate_grad_batches
        scale = float(self.trainer.world_size) * (accumulate if accumulated else 1)
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

    def named_parameters_of(self, params: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """(name, parameter) of each of `params` (the optimizer's), named as in the module."""
        wanted = {id(p) for p in params}
        return [(name, p) for name, p in self.named_parameters() if id(p) in wanted]

    def attached_strategy(self) -> Optional[Any]:
        """The trainer's strategy, or None for a module used on its own (tests, export)."""
        return self._trainer.strategy if self._trainer is not None else None

    def configure_optimizers(self) -> dict[str, Any]:
        optim = self.optim_args
        groups = self.optimizer_param_groups()
        params = [p for group in groups for p in group["params"]]
        refuse_float16_parameters(self.named_parameters_of(params), self.attached_strategy(), self._float16_setting())
        # torch's fused AdamW kernel (CPU and CUDA): one pass over the parameters instead of a loop of small ops,
        # about 10x faster on the 21M benchmark model (0.009 s vs 0.092 s per step on 2 CPU cores). Not with fp16
        # mixed precision: the gradient scaler must unscale before clipping, which a fused step does internally.
        fp16_scaled = self._trainer is not None and str(self._trainer.precision) == "16-mixed"
        fused = all(p.device.type in ("cpu", "cuda") for p in params) and not fp16_scaled
        optimizer = torch.optim.AdamW(groups, lr=optim.learning_rate, weight_decay=optim.weight_decay, fused=fused)
        warmup = max(optim.warmup_steps, 0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / (warmup + 1)))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _float16_setting(self) -> str:
        """The setting that makes the trained parameters float16, for `refuse_float16_parameters`'s message."""
        if self._trainer is not None and str(self._trainer.precision) == "16-true":
            return "trainer.precision 16-true"
        dtype = self.policy_args.dtype
        return f"model.policy.dtype {dtype}" + (" (the checkpoint's float16)" if dtype == "auto" else "")

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
        if not clip_gradients(self.trainer, optimizer, gradient_clip_val, gradient_clip_algorithm):
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)  # fp16's scaler; DeepSpeed's

    def parameters_sharded(self) -> bool:
        """Whether every forward gathers the parameters from all ranks (ZeRO-3, FSDP on several ranks): then all
        ranks must run the same forwards."""
        trainer = self._trainer
        return trainer is not None and trainer.world_size > 1 and shards_parameters(trainer.strategy)

    # -- metrics ---------------------------------------------------------------------------------------------
    def log_collection(self, collection: MetricCollection, on_step: bool, prog_bar: tuple[str, ...] = ()) -> None:
        """Compute (synced across ranks), log and reset every metric of `collection` that received data on any rank;
        one logged before that received none this time logs NaN (Lightning would repeat its last value: Online DPO's
        pair metrics on a step whose pairs all tied)."""
        values = {f"{collection.prefix}{name}": value for name, value in compute_collection(collection).items()}
        collection.reset()
        names = {f"{collection.prefix}{name}" for name in collection.keys(keep_base=True)}
        for name in (self._logged_metrics & names) - values.keys():
            values[name] = torch.tensor(float("nan"))
        self._logged_metrics.update(values)
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
