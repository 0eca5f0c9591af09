"""Strategy presets: Lightning's DeepSpeed strategy, also on CPU processes (gloo) so CI runs the real engine, with
atomic checkpoint directories.

`DeepSpeedStrategy` here is Lightning's own with three changes. Its checkpoint directories are written atomically
(see `DeepSpeedStrategy.save_checkpoint`). Under ZeRO-3 it moves what DeepSpeed leaves behind to the device (see
`DeepSpeedStrategy.setup`). With `--trainer.accelerator cpu` it skips the three CUDA-only parts of
Lightning's version: the accelerator check, the device-index validation, and a root device that must be a GPU
(each process reports `cpu:<local_rank>`). DeepSpeed itself detects its CPU accelerator and the process group runs
over gloo.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.strategies import DeepSpeedStrategy as LightningDeepSpeedStrategy

from lit_rl.errors import ReportedOnRankZero
from lit_rl.training.checkpoint import (
    publish_directory,
    remove_directory,
    remove_stale_temporaries,
    temporary_directory,
)
from lit_rl.training.compat import (
    accumulates_this_batch,
    can_take_data_of,
    set_module_device,
)


class DeepSpeedStrategy(LightningDeepSpeedStrategy):
    """Lightning's `DeepSpeedStrategy` (same arguments: `stage`, `offload_optimizer`, `config`, ...), able to run
    on CPU processes for tests; see the module docstring."""

    def _on_cpu(self) -> bool:
        return isinstance(self.accelerator, CPUAccelerator)

    def setup_environment(self) -> None:
        if self._on_cpu():
            DDPStrategy.setup_environment(self)  # Lightning's version refuses anything but CUDA
            return
        super().setup_environment()

    def setup_distributed(self) -> None:
        if self._on_cpu():
            reset_seed()
            self.set_world_ranks()
            self._init_deepspeed_distributed()  # without the CUDA device-index validation
            return
        super().setup_distributed()

    def _auto_select_batch_size(self) -> int:
        """`train_micro_batch_size_per_gpu` when the DeepSpeed config has none (DeepSpeed's throughput log reads
        it): the loader's batch size. Lightning's reads `batch_sampler.batch_size`, which a loader of batches built
        by the data module (`batch_size=None`: DPO's, SFT's) does not have, and failed there; 1 for those."""
        data_source = self.lightning_module.trainer.fit_loop._data_source
        sampler = getattr(data_source.dataloader(), "batch_sampler", None) if data_source.is_defined() else None
        return getattr(sampler, "batch_size", None) or 1

    @property
    def root_device(self) -> torch.device:
        if self._on_cpu():
            return torch.device("cpu", self.local_rank)
        return super().root_device

    def init_deepspeed(self) -> None:
        """Lightning's, with its warning that an overridden `configure_gradient_clipping` "will not actually clip
        gradients" replaced by one line saying how they are clipped: lit-rl's override leaves DeepSpeed's case to
        DeepSpeed, whose `gradient_clipping` Lightning sets from `trainer.gradient_clip_val` (unless the DeepSpeed
        config sets it), and the engine clips by the norm over every rank's partition of the gradients."""
        if (self.config.get("zero_optimization") or {}).get("offload_optimizer"):
            # lit-rl's optimizer is torch's AdamW, which DeepSpeed refuses beside an offloaded optimizer state unless
            # told otherwise (it wants its own compiled `DeepSpeedCPUAdam`): AdamW then steps on the CPU partitions.
            self.config.setdefault("zero_force_ds_cpu_optimizer", False)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Since DeepSpeed handles gradient clipping internally")
            super().init_deepspeed()
        clip = float(self.config.get("gradient_clipping") or 0.0)
        if clip > 0 and self.lightning_module.trainer.state.fn == "fit":
            from lit_rl.resume import say

            given = float(self.lightning_module.trainer.gradient_clip_val or 0.0)
            source = "trainer.gradient_clip_val" if clip == given else "the DeepSpeed config's gradient_clipping"
            say(
                f"gradient clipping under DeepSpeed ZeRO-{self.config.get('zero_optimization', {}).get('stage', 0)}: "
                f"its engine clips to a norm of {clip:g} over every rank's gradients ({source})"
            )

    def setup(self, trainer: Any) -> None:
        """Lightning's setup, then, under ZeRO-3, the module's unpartitioned state onto the root device. DeepSpeed
        does not move a model built under `zero.Init` (its parameters are already partitioned onto the device), so
        everything else the LightningModule holds (metric states, buffers, modules built outside `zero.Init`) would
        stay on the CPU, and the module's `device` with it: the first metric update on a GPU fails."""
        super().setup(trainer)
        if self.zero_stage_3:
            move_unpartitioned_state(self.lightning_module, self.root_device)

    def save_checkpoint(self, checkpoint: dict, filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Write the checkpoint directory `filepath` atomically: every rank writes its shards into `.<name>.tmp`
        beside it; once all have finished, one rank fsyncs it and renames it to `filepath` (replacing an existing
        one, or a `last.ckpt` symlink, in one exchange). A process killed mid-save leaves every earlier checkpoint
        intact and the final name absent; the next save removes the temporary it left. Remote (URL) paths, node-local
        storage and DeepSpeed's decoupled (asynchronous) checkpoint engines keep DeepSpeed's own writer."""
        filepath = self.broadcast(filepath)
        if "://" in str(filepath) or not self._atomic_saves():
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        path = Path(filepath)
        tmp = temporary_directory(path)
        if self.is_global_zero:
            path.parent.mkdir(parents=True, exist_ok=True)
            remove_stale_temporaries(path.parent)
        self.barrier("lit_rl.save_checkpoint.prepare")
        super().save_checkpoint(checkpoint, str(tmp), storage_options)  # ends with DeepSpeed's own barrier
        if self.is_global_zero:
            publish_directory(tmp, path)
        self.barrier("lit_rl.save_checkpoint.publish")

    def remove_checkpoint(self, filepath: Any) -> None:
        """Remove a checkpoint directory without ever leaving it half-removed under its name (`remove_directory`)."""
        if "://" in str(filepath):
            return super().remove_checkpoint(filepath)
        if self.is_global_zero:
            remove_directory(Path(filepath))

    def _atomic_saves(self) -> bool:
        engine = self.deepspeed_engine
        decoupled = getattr(getattr(engine, "checkpoint_engine", None), "is_decoupled", lambda: False)()
        return not (decoupled or engine.use_node_local_storage())


def move_unpartitioned_state(module: torch.nn.Module, device: torch.device) -> None:
    """Move every parameter and buffer of `module` that ZeRO-3 does not manage (no `ds_id`), and every torchmetrics
    metric's states, to `device`; ZeRO-3's parameters are left exactly as DeepSpeed placed them. A LightningModule's
    `device` then reports `device`."""
    from torchmetrics import Metric

    for sub in module.modules():
        if isinstance(sub, Metric):
            sub.to(device)  # its states are attributes, not buffers; a metric holds no ZeRO-3 parameter
            continue
        for name, param in list(sub.named_parameters(recurse=False, remove_duplicate=False)):
            if hasattr(param, "ds_id") or param.device == device:
                continue
            moved = param.data.to(device)
            if can_take_data_of(param, moved):  # as nn.Module._apply: keep the Parameter
                param.data = moved
            else:
                setattr(sub, name, torch.nn.Parameter(moved, requires_grad=param.requires_grad))
        for name, buffer in list(sub.named_buffers(recurse=False, remove_duplicate=False)):
            if buffer.device != device:
                setattr(sub, name, buffer.to(device))  # stays a buffer, persistent or not
    set_module_device(module, device)


def as_project_deepspeed(strategy: Any) -> Any:
    """Lightning's DeepSpeed strategy, given by a registered name (`deepspeed`, `deepspeed_stage_3_offload`, ...)
    or as an instance of Lightning's class, -> this module's `DeepSpeedStrategy` with the same arguments (atomic
    checkpoint directories, CPU processes); anything else is returned as it is."""
    if isinstance(strategy, str) and strategy in StrategyRegistry:
        entry = StrategyRegistry[strategy]
        if issubclass(entry["strategy"], LightningDeepSpeedStrategy):
            return DeepSpeedStrategy(**entry["init_params"])
    elif type(strategy) is LightningDeepSpeedStrategy:
        strategy.__class__ = DeepSpeedStrategy  # the subclass adds methods only, no state: the instance is unchanged
    return strategy


def deepspeed_engine(strategy: object) -> Optional[Any]:
    """The DeepSpeed engine of `strategy` once it is set up; None under any other strategy."""
    if not isinstance(strategy, LightningDeepSpeedStrategy):
        return None
    import deepspeed

    return strategy.model if isinstance(strategy.model, deepspeed.DeepSpeedEngine) else None


def master_weights(strategy: object, module: torch.nn.Module, keep: bool) -> Optional[dict[str, torch.Tensor]]:
    """`module`'s trainable parameters as the float32 master copies DeepSpeed's optimizer keeps when the engine
    computes in bf16 or fp16 (the module's own are their rounded copies), by parameter name, on CPU; None under any
    other strategy or precision. A collective (ZeRO assembles each from every rank's partition): every rank calls
    it, and only where `keep` (rank 0) are the tensors kept. Where they do not fit in host memory, rank 0 goes on
    taking part without keeping them (a rank leaving the collectives would hang the others) and returns None, with
    one line saying so; None too where the engine keeps no masters (fp16 without ZeRO)."""
    engine = deepspeed_engine(strategy)
    if engine is None or not (engine.bfloat16_enabled() or engine.fp16_enabled()):
        return None
    from deepspeed.utils import safe_get_full_fp32_param

    weights: Optional[dict[str, torch.Tensor]] = {} if keep else None
    for name, param in module.named_parameters():
        full = safe_get_full_fp32_param(param) if param.requires_grad else None  # frozen ones have no master
        if full is None or weights is None:
            continue
        try:
            weights[name] = full.detach().cpu()
        except RuntimeError as err:  # the CPU allocator's "can't allocate memory"
            warnings.warn(
                f"hf/: the float32 master weights do not fit in host memory ({err}): the engine's own copies "
                "are exported; `lit-rl export` of the last checkpoint writes the masters",
                stacklevel=2,
            )
            weights = None
    return weights or None


def deepspeed_local_gradients(engine: Any) -> list[torch.Tensor]:
    """This rank's gradients where the engine's optimizer keeps them, after the backward of the last micro-batch
    of an accumulation window and before `engine.step()`: already reduced across ranks, and under ZeRO-2/3 only
    this rank's partition (`param.grad` is None there). A non-finite value shows on the rank that owns it only."""
    optimizer = engine.optimizer
    flat = getattr(optimizer, "grad_partitions_flat_buffer", None)  # ZeRO-3: all of this rank's partitions
    if isinstance(flat, torch.Tensor):
        return [flat]
    grads: list[Optional[torch.Tensor]] = []
    for group in (getattr(optimizer, "averaged_gradients", None) or {}).values():  # ZeRO-1/2
        grads += group if isinstance(group, (list, tuple)) else [group]
    if getattr(optimizer, "cpu_offload", False):  # ZeRO-1/2 with the optimizer offloaded: fp32 partitions on CPU
        grads += [partition.grad for partition in optimizer.single_partition_of_fp32_groups]
    grads += [p.grad for p in engine.module.parameters()]  # no ZeRO: whole gradients, all-reduced
    return [g for g in grads if g is not None]


def deepspeed_discards_non_finite_steps(engine: Any) -> bool:
    """Whether `engine.step()` discards a step whose gradients are non-finite (weights and optimizer state
    unchanged, `engine.was_step_applied()` False), as DeepSpeed's ZeRO optimizers do: ZeRO-3 always (an invalid
    gradient norm is an overflow); ZeRO-1/2 with `check_grad_overflow` or, outside bf16, a computed norm."""
    stage = engine.zero_optimization_stage()
    if stage == 3:
        return True
    if stage in (1, 2):
        optimizer = engine.optimizer
        checks_norm = (
            getattr(optimizer, "compute_grad_norm", True) and getattr(optimizer, "dtype", None) != torch.bfloat16
        )
        return bool(getattr(optimizer, "check_grad_overflow", False) or checks_norm)
    return False


def is_zero3(strategy: object) -> bool:
    return isinstance(strategy, LightningDeepSpeedStrategy) and strategy.zero_stage_3


@contextmanager
def hf_zero3_loading(strategy: object) -> Iterator[None]:
    """Let `from_pretrained` load into ZeRO-3 partitions (no-op under any other strategy).

    Lightning runs `configure_model` inside `deepspeed.zero.Init`, so every parameter is a placeholder of size 0 as
    soon as it is created. Registered as `HfDeepSpeedConfig`, the strategy's config tells transformers so: it then
    gathers each module's shards while it fills them from the checkpoint.
    """
    if not is_zero3(strategy):
        yield
        return
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    hf_config = HfDeepSpeedConfig(strategy.config)  # transformers holds a weak reference: keep this one alive
    try:
        yield
    finally:
        unset_hf_deepspeed_config()
        del hf_config


def shards_parameters(strategy: object) -> bool:
    """Whether every forward pass is a collective (ZeRO-3 or FSDP): ranks must then run the same number of them."""
    from lightning.pytorch.strategies import FSDPStrategy

    return is_zero3(strategy) or isinstance(strategy, FSDPStrategy)


@contextmanager
def gathered_parameters(module: torch.nn.Module, modifier_rank: Optional[int] = None) -> Iterator[None]:
    """Inside, every parameter of `module` is whole on every rank (ZeRO-3 partitions or FSDP shards gathered; a
    no-op otherwise). A collective: every rank must enter it. (The FSDP path needs GPUs and is untested here.)
    With `modifier_rank`, what that rank writes into them is partitioned back to every rank (ZeRO-3 only)."""
    if is_fsdp_wrapped(module):
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(module, writeback=False, recurse=True):
            yield
        return
    with gathered_parameters_of(list(module.parameters()), modifier_rank):
        yield


@contextmanager
def gathered_parameters_of(params: list[torch.nn.Parameter], modifier_rank: Optional[int] = None) -> Iterator[None]:
    """Inside, the ZeRO-3 parameters among `params` are whole on every rank (others are left as they are). A
    collective under ZeRO-3: every rank must enter it with the same parameters."""
    partitioned = [p for p in params if hasattr(p, "ds_id")]
    if not partitioned:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=modifier_rank):
        yield


@contextmanager
def zero3_whole_weights(strategy: object, module: torch.nn.Module) -> Iterator[None]:
    """Under ZeRO-3, inside: `module`'s parameters whole on every rank and DeepSpeed's hooks on its modules hidden, so
    its forwards gather nothing (a no-op under any other strategy). A collective: every rank enters it.

    For decoding (TRL's `ds3_gather_for_generation`): through the hooks, every one-token forward gathers each layer's
    parameters and releases them again, and the ranks must step together. Gathered once per `generate` call (each
    turn of a tool episode), it holds one whole copy of `module` per rank while it lasts. TRL and DeepSpeed's own
    `unwrap_model_for_generation` remove the hooks and register them anew, which gives every module a new id and
    throws DeepSpeed's prefetch trace away at every generation; here the forwards inside do not see them, and
    DeepSpeed's state is left as it was.
    """
    if not is_zero3(strategy):
        yield
        return
    import deepspeed

    offload = _zero3_parameter_offload(strategy)
    # Nothing prefetched, in flight or held for a module before gathering: what `settle_zero3_parameters` does,
    # without the engine's `gc.collect()` and cache release (0.36 s per generation of the tiny model on CPU).
    offload.empty_partition_cache()
    deepspeed_hooks = {handle.id for handle in [*offload.forward_hooks, *offload.backward_hooks]}
    with deepspeed.zero.GatheredParameters(list(module.parameters())), _hooks_hidden(module, deepspeed_hooks):
        yield


@contextmanager
def _hooks_hidden(module: torch.nn.Module, hook_ids: set[int]) -> Iterator[None]:
    """Inside, the forward (pre-)hooks of `module` and its submodules whose ids are in `hook_ids` do not run; on the
    way out each module gets back its own hook dicts, unchanged (their handles still remove them)."""
    saved = [(m, m._forward_pre_hooks, m._forward_hooks) for m in module.modules()]
    for m, pre_hooks, hooks in saved:
        m._forward_pre_hooks = OrderedDict((i, h) for i, h in pre_hooks.items() if i not in hook_ids)
        m._forward_hooks = OrderedDict((i, h) for i, h in hooks.items() if i not in hook_ids)
    try:
        yield
    finally:
        for m, pre_hooks, hooks in saved:
            m._forward_pre_hooks, m._forward_hooks = pre_hooks, hooks


def _zero3_parameter_offload(strategy: object) -> Any:
    """The DeepSpeed object that holds the ZeRO-3 module hooks (`forward_hooks`, `backward_hooks`)."""
    optimizer = strategy.deepspeed_engine.optimizer
    return getattr(optimizer, "parameter_offload", optimizer)


def settle_zero3_parameters(strategy: object) -> None:
    """Under ZeRO-3, wait for the parameters DeepSpeed is prefetching and release every gathered one (a no-op
    otherwise). A training step runs inside the DeepSpeed engine's forward, whose hooks prefetch the parameters
    the recorded trace expects next; gathering those for anything else (a weight push) then fails with "Cannot
    partition a param in flight". Modules gather what they need again at their next forward."""
    if is_zero3(strategy):
        strategy.deepspeed_engine.empty_partition_cache()


def is_fsdp_wrapped(module: torch.nn.Module) -> bool:
    """Whether `module` is (or holds) an FSDP-wrapped module, whose parameters are sharded flat."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(isinstance(m, FullyShardedDataParallel) for m in module.modules())


def is_accumulating_micro_batch(trainer) -> bool:
    """True on the micro-batches before the last of an accumulation window under DeepSpeed, where Lightning calls
    the optimizer-step hooks on every micro-batch (the engine decides when to step). Hooks meant to run once per
    optimizer step return early when this is True."""
    return trainer.strategy.handles_gradient_accumulation and accumulates_this_batch(trainer)


_REDUCE_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN"}


def reduce_across_ranks(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """`tensor` reduced (`sum`, `max` or `min`) over every rank, as a new tensor, in one all-reduce; `tensor` itself
    when there is one process. Lightning's `strategy.reduce` runs a barrier before its all-reduce: a second
    collective that costs as much as the first and buys nothing (an all-reduce already waits for every rank)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return tensor
    reduced = tensor.detach().clone()
    dist.all_reduce(reduced, op=getattr(dist.ReduceOp, _REDUCE_OPS[op]))
    return reduced


def fail_on_every_rank(
    error: Optional[Exception | str],
    kind: type[Exception],
    elsewhere: str,
    world_size: int,
    global_rank: int,
    device: torch.device,
) -> None:
    """Stop every rank when any rank has an `error` (an exception, or a message for `kind`): a rank that raised
    alone would leave the others in the next collective until a timeout. One all-reduce when none failed.
    With several ranks, the error is reported once, by rank 0: the first failed rank's message with its rank
    (`kind`, or `elsewhere` where the message cannot be sent); the other ranks raise `ReportedOnRankZero`,
    which the CLI ends without a line of its own."""
    failed = float(error is not None)
    if world_size > 1:
        failed = float(reduce_across_ranks(torch.tensor(failed, device=device)))
    if not failed:
        return
    if world_size == 1:
        raise error if isinstance(error, Exception) else kind(error or elsewhere)
    messages: list[Optional[str]] = [None] * world_size
    torch.distributed.all_gather_object(messages, None if error is None else str(error))
    rank, message = next((r, m) for r, m in enumerate(messages) if m is not None)
    if global_rank != 0:
        raise ReportedOnRankZero(f"rank {rank} failed; rank 0 reports it") from (
            error if isinstance(error, Exception) else None
        )
    cause = error if isinstance(error, Exception) and rank == 0 else None
    raise kind(f"{message} (on rank {rank})" if message else elsewhere) from cause
