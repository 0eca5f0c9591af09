"""Strategy presets: Lightning's DeepSpeed strategy, also on CPU processes (gloo) so CI runs the real engine.

On CUDA, `DeepSpeedStrategy` here is Lightning's own, unchanged. With `--trainer.accelerator cpu` it skips the
three CUDA-only parts of Lightning's version: the accelerator check, the device-index validation, and a root
device that must be a GPU (each process reports `cpu:<local_rank>`). DeepSpeed itself detects its CPU
accelerator and the process group runs over gloo.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies import DeepSpeedStrategy as LightningDeepSpeedStrategy


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

    @property
    def root_device(self) -> torch.device:
        if self._on_cpu():
            return torch.device("cpu", self.local_rank)
        return super().root_device


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
    return trainer.strategy.handles_gradient_accumulation and trainer.fit_loop._should_accumulate()
