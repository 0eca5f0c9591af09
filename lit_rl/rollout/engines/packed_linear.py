"""Linear layers on float32 weights packed once per generation, for compiled decoding on CPU.

A decoding step multiplies a few rows (one token of each completion) by every weight matrix, so on a CPU each
matmul is bound by reading its weight. MKL reads a float32 weight faster from its own packed layout than from the
row-major one `F.linear` is given on every call: at 16 rows on 2 cores of a Xeon, a packed 1 MiB weight multiplies in
about half the time. Here each weight is packed at its first use in a generation (`mkl._mkl_reorder_linear_weight`,
what inductor's weight freezing does for inference) and every later token's step multiplies the packed copy.

Unlike freezing, nothing is baked into the compiled graph: `torch.ops.lit_rl.packed_linear(x, weight, bias)` takes
the live weight, so the graph compiles once and follows every optimizer step. Packs live only inside
`packed_weights()`, which the decoder enters around one generation (the weights cannot change within one: no
gradients, no optimizer); a weight is packed again if its version counter moved anyway, and outside the context the
op is `F.linear`. The products are MKL's on the same numbers, equal to `F.linear`'s to float rounding
(`tests/test_packed_linear.py`).

bfloat16 weights are not packed: oneDNN's reorder of a 1 MiB bf16 weight took about 0.5 ms on the same machine, and
since training changes the weights before every generation, packing them for each one left a 32-token generation
of the 21M-parameter model no faster (1.00x to 1.09x the time).
"""

from __future__ import annotations

import platform
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

_library = torch.library.Library("lit_rl", "DEF")
_library.define("packed_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")

# (weight's data pointer, rows) -> (the weight's version when packed, the packed weight); None outside a generation.
_packs: Optional[dict[tuple[int, int], tuple[int, torch.Tensor]]] = None

# Smaller weights are read fast enough as they are: at 16 rows, packed 512 KiB and 1 MiB weights multiplied in about
# 0.5x `F.linear`'s time, 256 KiB ones in 0.75x to 0.9x, a 64 KiB one in 1.3x (the op's own overhead).
MIN_PACKED_BYTES = 512 << 10


def packs_float32() -> bool:
    """Whether this CPU packs float32 weights: an x86 build of torch with MKL."""
    return platform.machine().lower() in ("x86_64", "amd64") and torch.backends.mkl.is_available()


_PACKS_FLOAT32 = packs_float32()


@contextmanager
def packed_weights() -> Iterator[dict]:
    """Within: `packed_linear` packs each weight at its first call and reuses the pack; on exit the packs are freed.
    Yields the packs (for tests)."""
    global _packs
    saved, _packs = _packs, {}
    try:
        yield _packs
    finally:
        _packs = saved


def _packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    if _packs is None:
        return F.linear(x, weight, bias)
    rows = x.numel() // x.shape[-1]  # a pack is made for a row count (MKL reads the weight as given for others)
    key = (weight.data_ptr(), rows)
    entry = _packs.get(key)
    if entry is None or entry[0] != weight._version:
        entry = _packs[key] = (weight._version, torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), rows))
    return torch.ops.mkl._mkl_linear(x, entry[1], weight, bias, rows)


def _packed_linear_shape(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


_library.impl("packed_linear", _packed_linear, "CPU")
_library.impl("packed_linear", _packed_linear_shape, "Meta")


def packs_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
    """Whether `F.linear(x, weight, bias)` is one to pack: float32 throughout, a weight of at least
    `MIN_PACKED_BYTES`, on CPU, without gradients or autocast (which would compute in bfloat16)."""
    return (
        _PACKS_FLOAT32
        and weight.dtype == torch.float32
        and x.dtype == torch.float32
        and (bias is None or bias.dtype == torch.float32)
        and weight.numel() * weight.element_size() >= MIN_PACKED_BYTES
        and x.device.type == "cpu"
        and weight.dim() == 2
        and x.dim() >= 2
        and not torch.is_grad_enabled()
        and not torch.is_autocast_enabled("cpu")
    )


class PackedLinearMode(torch.overrides.TorchFunctionMode):
    """Routes `F.linear` calls that `packs_linear` accepts to `torch.ops.lit_rl.packed_linear`. Entered inside the
    compiled decoding step, so the compiled graph calls the op in place of each such weight matmul."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and len(args) >= 2:  # how `nn.Linear.forward` calls it
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if packs_linear(x, weight, bias):
                return torch.ops.lit_rl.packed_linear(x, weight, bias)
        return func(*args, **kwargs)
