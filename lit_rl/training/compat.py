"""The private internals of Lightning, torch, torchmetrics, transformers and jsonargparse that lit-rl must touch, in
one place: each use is a function here, so an upgrade that renames one breaks this module and its test
(`tests/test_compat.py`, which runs each against the installed library), not a call site deep in a callback.

Lightning 2.5-2.6, torch 2.6-2.13, torchmetrics 1.7+, transformers 5.16-5.19. Imports are lazy:
the forward path (`lit_rl.modeling.packing`) may use this module without importing Lightning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

if TYPE_CHECKING:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torchmetrics import Metric


# -- Lightning ----------------------------------------------------------------------------------------------------
def mark_step_saved(callback: ModelCheckpoint, step: int) -> None:
    """Tell `callback` that `step` is saved already, so that it does not save that step again
    (`ModelCheckpoint._last_global_step_saved`, the step it last saved)."""
    callback._last_global_step_saved = max(callback._last_global_step_saved, step)


def mark_last_written(callback: ModelCheckpoint, path: str, step: int) -> None:
    """Tell `callback` that `path` is its last checkpoint, written at `step`: it writes no other one for that step
    (at the end of the epoch or of `fit`; `ModelCheckpoint._last_checkpoint_saved`)."""
    callback._last_checkpoint_saved = path
    mark_step_saved(callback, step)


def accumulates_this_batch(trainer: L.Trainer) -> bool:
    """Whether the current training batch is one before the last of its accumulation window (the fit loop's
    `_should_accumulate`, which Lightning asks before it steps the optimizer)."""
    return trainer.fit_loop._should_accumulate()


def skip_next_validation(trainer: L.Trainer) -> None:
    """Skip the validation Lightning would run next (it validates when a run is asked to stop early:
    `_skip_next_val` of the training epoch loop)."""
    trainer.fit_loop.epoch_loop._skip_next_val = True


def set_module_device(module: torch.nn.Module, device: torch.device) -> None:
    """Make a LightningModule's `device` report `device` after its tensors were moved by hand (its `_device`,
    which only its own `.to()` updates); a plain module has none."""
    if hasattr(module, "_device"):
        module._device = device


# -- torch --------------------------------------------------------------------------------------------------------
def set_group_sequence_number(backend: Any) -> None:
    """Rank 0's part of a process group's start: publish its sequence number, which the other ranks wait for
    (`_set_sequence_number_for_group`, as `torch.distributed.new_group` calls it)."""
    backend._set_sequence_number_for_group()


def foreach_norm(tensors: list[torch.Tensor], dtype: Optional[torch.dtype] = None) -> list[torch.Tensor]:
    """The L2 norm of each tensor, in `dtype` (None: the tensor's own), in one fused kernel per (device, dtype)
    group (`torch._foreach_norm`, the kernel `clip_grad_norm_` uses)."""
    return list(torch._foreach_norm(tensors, 2, dtype=dtype))


def version_counter(tensor: torch.Tensor) -> int:
    """How many times `tensor` (or a view sharing its storage) was written in place by a tensor operation
    (`Tensor._version`, autograd's check that saved tensors did not change)."""
    return tensor._version


def persistent_buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A module's own buffers that its state dict holds, without those registered `persistent=False` (the set
    `nn.Module._non_persistent_buffers_set`)."""
    transient = module._non_persistent_buffers_set
    buffers = module.named_buffers(recurse=False, remove_duplicate=False)  # an alias under each of its names
    return [(name, b) for name, b in buffers if name not in transient]


def can_take_data_of(param: torch.Tensor, moved: torch.Tensor) -> bool:
    """Whether `param.data = moved` keeps `param` the same Parameter object (the test `nn.Module._apply` makes:
    `torch._has_compatible_shallow_copy_type`)."""
    return torch._has_compatible_shallow_copy_type(param, moved)


# -- torchmetrics -------------------------------------------------------------------------------------------------
def state_reductions(metric: Metric) -> dict[str, Callable | None]:
    """Each state of `metric` with its `dist_reduce_fx` (`Metric._reductions`)."""
    return dict(metric._reductions)


# -- transformers -------------------------------------------------------------------------------------------------
def attention_implementation(model: torch.nn.Module) -> str:
    """The attention kernel a Hugging Face model runs (`config._attn_implementation`: "eager", "sdpa",
    "flash_attention_2", ...), or "" for a model without a config."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None) or ""


def flash_attention_installed(implementation: str) -> bool:
    """Whether the package behind `flash_attention_N` is installed (transformers'
    `FLASH_ATTENTION_COMPATIBILITY_MATRIX` availability check). Without it, transformers downloads a hub kernel in
    its place when the `kernels` package is installed (`FLASH_ATTN_KERNEL_FALLBACK`)."""
    from transformers.modeling_flash_attention_utils import FLASH_ATTENTION_COMPATIBILITY_MATRIX

    version = int(implementation.removeprefix("flash_attention_"))
    entry = FLASH_ATTENTION_COMPATIBILITY_MATRIX.get(version)
    return entry is not None and bool(entry["general_availability_check"]())


# -- jsonargparse ---------------------------------------------------------------------------------------------------
def keep_nested_nulls() -> None:
    """Let `null` reach a nested option of a class given by class path (`--model.rewards.weights null`).

    jsonargparse 4.53 reads the value first (`null` -> None), then passes it to the class's own parser as the text
    `f"--{key}={value}"`, where None became the word `None` ("Expected a list, given 'None'"). The value is kept
    as the text `null` instead, which that parser reads as null. Idempotent."""
    import jsonargparse._typehints as typehints
    from jsonargparse._util import NestedArg

    original = typehints.parse_value_or_config
    if getattr(original, "keeps_nested_nulls", False):
        return

    def parse_value_or_config(value, *args, **kwargs):
        parsed, path = original(value, *args, **kwargs)
        if isinstance(parsed, NestedArg) and parsed.val is None:
            parsed = NestedArg(key=parsed.key, val="null")
        return parsed, path

    parse_value_or_config.keeps_nested_nulls = True
    typehints.parse_value_or_config = parse_value_or_config
