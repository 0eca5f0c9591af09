"""The global gradient norm, computed once per step for the non-finite guard and for clipping, clipping by it that
leaves the gradients alone when they are already within the cap, the clipping rule of every lit-rl module under
each strategy and precision (`clip_gradients`), and the one parameter dtype AdamW cannot train
(`refuse_float16_parameters`)."""

from __future__ import annotations

import weakref
from typing import Iterable, Optional

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

from lit_rl.errors import ConfigError
from lit_rl.training.compat import version_counter

# A norm the non-finite guard computed for clipping to take: weak references to its tensors, their version
# counters, and the norm.
_handed_over: Optional[tuple[tuple[weakref.ref, ...], tuple[int, ...], torch.Tensor]] = None


def total_norm(grads: list[torch.Tensor], hand_over: bool = False) -> torch.Tensor:
    """The L2 norm of all of `grads` together, ||g||_2 = sqrt(sum_i ||g_i||_2^2), exactly as
    `torch.nn.utils.clip_grad_norm_` computes it (its `get_total_norm`: each tensor's norm in its own dtype, float32
    accumulation).

    Before each optimizer step the non-finite guard and then clipping both need it; reading every gradient twice
    cost about 6 ms of a 0.24 s bf16 DPO step on the 21M model. So the guard computes it with `hand_over=True`,
    which keeps it, and the next call takes it instead of computing it again, once, and only for the same live
    tensors at the same version counters. Tensor operations that write in place bump a tensor's counter; writes
    that bypass it (through `.data`, or a `torch.distributed` collective) would go unseen, so the norm is handed
    over only across a short gap: from the guard's `on_before_optimizer_step` to `configure_gradient_clipping`,
    between which Lightning runs only the later callbacks' and the module's own `on_before_optimizer_step` (lit-rl's
    callbacks after the guard and its modules' hooks only log)."""
    global _handed_over
    versions = tuple(version_counter(g) for g in grads)
    kept, _handed_over = _handed_over, None
    if kept is not None and not hand_over:
        refs, kept_versions, norm = kept
        if kept_versions == versions and all(r() is g for r, g in zip(refs, grads)):  # equal versions: equal lengths
            return norm
    norm = torch.nn.utils.get_total_norm(grads, 2.0)  # torch >= 2.6
    if hand_over:
        _handed_over = (tuple(weakref.ref(g) for g in grads), versions, norm)
    return norm


def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float) -> None:
    """Scale the gradients of `params` in place so that their global L2 norm is at most `max_norm`, exactly as
    `torch.nn.utils.clip_grad_norm_` does:

        g <- g * min(1, max_norm / (||g||_2 + 1e-6)),   ||g||_2 = `total_norm` of every gradient together,

    except that the multiply is skipped when that factor is 1. torch multiplies by the clamped factor regardless,
    to spare a host-device sync; a skipped multiply gives the same bits (x * 1.0 == x) and saves a read and a write
    of every gradient on the steps that need no clipping. The sync costs a scalar per optimizer step on a GPU."""
    params = [p for p in params if p.grad is not None]
    if not params:
        return
    norm = total_norm([p.grad for p in params])
    coefficient = max_norm / (norm + 1e-6)  # torch's, before its clamp at 1
    if not bool(coefficient >= 1):  # a NaN norm multiplies too: torch makes every gradient NaN then
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)


def clip_gradients(
    trainer: Trainer, optimizer: torch.optim.Optimizer, value: Optional[float], algorithm: Optional[str]
) -> bool:
    """`configure_gradient_clipping` of every lit-rl module (on `trainer`): clip the gradients of `optimizer`'s
    parameters to `value` by `algorithm` (`norm` or `value`), as below. False where Lightning's own clipping must
    run instead (the module's `clip_gradients`)."""
    # Without a loss scaler (fp32, bf16-true, 16-true, bf16-mixed) the gradients are clipped here: by norm with
    # `clip_grad_norm_` above, torch's without the multiply on steps under the cap. Under
    # bf16-mixed that also sidesteps Lightning's refusal to clip for a fused optimizer (which it makes in case
    # the optimizer unscales fp16 gradients itself; bf16 has nothing to unscale). fp16 mixed precision (a
    # scaler to unscale first) and DeepSpeed (which clips inside its engine) keep Lightning's path. A value
    # <= 0 clips nothing, as in Lightning.
    # Lightning's FSDP plugin refuses norm clipping: the norm is over every rank's shards, which the FSDP root
    # module's `clip_grad_norm_` computes (torch's function does for FSDP2's DTensor parameters).
    if value is None or value <= 0:
        return True
    if isinstance(trainer.strategy, FSDPStrategy) and algorithm != "value":
        root = trainer.strategy.model
        if hasattr(root, "clip_grad_norm_"):
            root.clip_grad_norm_(value)
        else:
            torch.nn.utils.clip_grad_norm_(list(root.parameters()), value)
        return True
    plugin = trainer.precision_plugin
    unscaled = type(plugin) in (Precision, HalfPrecision) or (
        isinstance(plugin, MixedPrecision) and plugin.precision == "bf16-mixed"
    )
    if unscaled:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if algorithm == "value":
            torch.nn.utils.clip_grad_value_(params, value)
        else:
            clip_grad_norm_(params, value)  # torch's, without the multiply when under the cap
        return True
    return False  # fp16's scaler; DeepSpeed's own


def refuse_float16_parameters(named: list[tuple[str, torch.Tensor]], strategy: object, setting: str) -> None:
    """A one-line `ConfigError` (starting with `setting`, what made them float16) where AdamW would train float16
    parameters itself. It keeps its moments in the parameters' dtype, and float16's smallest value is 6e-8: the
    second moment it stores, (1 - beta2) g^2 = 1e-3 g^2, is 0 for every gradient below about 1e-2 while the first
    moment is not, so a later step with a small gradient moves by about lr * m / eps (configs/grpo.yaml with float16
    weights: the reward fell from 0.53 to 0.04 by step 4, in every layout `lit-rl check` ran). DeepSpeed
    keeps float32 master weights for its float16 training, and LoRA's adapters over float16 weights are float32
    (peft's default), so those train; `trainer.precision 16-mixed` keeps float32 parameters. `named`: the trained
    (name, parameter) pairs; the message names the first float16 one and how many there are."""
    half = [name for name, p in named if p.dtype == torch.float16]
    if isinstance(strategy, DeepSpeedStrategy) or not half:
        return
    raise ConfigError(
        f"{setting}: AdamW cannot train float16 parameters ({half[0]} and {len(half) - 1} more: its second moments "
        "underflow to 0 in float16 and the updates blow up within steps); train float32 parameters with "
        "--trainer.precision 16-mixed (float16 compute with a loss scaler) or use bfloat16 where the hardware has it"
    )
