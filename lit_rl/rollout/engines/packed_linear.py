"""Linear layers on float32 weights packed once per generation, for compiled decoding on CPU.

A decoding step multiplies a few rows (one token of each completion) by every weight matrix, so on a CPU each
matmul is bound by reading its weight. MKL reads a float32 weight faster from its own packed layout than from the
row-major one `F.linear` is given on every call. Here each weight is packed at its first use in a generation
(`mkl._mkl_reorder_linear_weight`, what inductor's weight freezing does for inference) and every later token's step
multiplies the packed copy. `benchmarks/packed_linear.py` measures one product either way and the cost of packing.

Unlike freezing, nothing is baked into the compiled graph: `torch.ops.lit_rl.packed_linear(x, weight, bias)` takes
the live weight, so the graph compiles once and follows every optimizer step. Packs live only inside
`packed_weights()`, which the decoder enters around one generation (the weights cannot change within one: no
gradients, no optimizer); a weight is packed again if its version counter moved anyway, and outside the context the
op is `F.linear`. Only parameters are packed (not views of them, nor weights computed in the forward, which can
share an address), and each pack holds its parameter, so no other tensor can take its address during the
generation. The products are MKL's on the same numbers, equal to `F.linear`'s to float rounding
(`tests/test_packed_linear.py`). Memory: during a generation the packs are a second copy of the packed weights.

bfloat16 weights are not packed: oneDNN's bfloat16 packs save less and cost more to make (repaid after 6 to 25
one-token steps in `benchmarks/packed_linear.py`, before this op's own overhead), and training changes the weights
before every generation, so a pack would serve one generation of a few dozen tokens.
"""

from __future__ import annotations

import platform
import threading
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

_library = torch.library.Library("lit_rl", "FRAGMENT")
_library.define("packed_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")

# Smaller weights are read fast enough as they are: a packed 256 KiB weight multiplied no faster than `F.linear`
# once the op's own overhead is counted, 1 MiB ones in about 0.75x its time (`benchmarks/packed_linear.py`).
MIN_PACKED_BYTES = 512 << 10


def packs_float32() -> bool:
    """Whether this CPU packs float32 weights: an x86 build of torch with MKL and oneDNN (MKL's packs are oneDNN
    tensors)."""
    return (
        platform.machine().lower() in ("x86_64", "amd64")
        and torch.backends.mkl.is_available()
        and torch.backends.mkldnn.is_available()
    )


_PACKS_FLOAT32 = packs_float32()

# This thread's packs while it decodes: (address, shape, stride, rows) -> (the parameter, its version when packed,
# the pack); no attribute outside a generation.
_generation = threading.local()


@contextmanager
def packed_weights() -> Iterator[dict]:
    """Within: `packed_linear` packs each parameter at its first call and reuses the pack; on exit the packs are
    freed. Yields the packs (for tests)."""
    saved = getattr(_generation, "packs", None)
    _generation.packs = packs = {}
    try:
        yield packs
    finally:
        _generation.packs = saved


def pack(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """`weight` in MKL's layout for products with `rows` rows."""
    return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), rows)


def _packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    packs = getattr(_generation, "packs", None)
    if packs is None or weight.is_inference():  # outside a generation; inference tensors have no version counter
        return F.linear(x, weight, bias)
    # A pack serves the row count it was made for (MKL would read the weight as given for other counts).
    rows = x.numel() // x.shape[-1]
    key = (weight.data_ptr(), weight.shape, weight.stride(), rows)
    entry = packs.get(key)
    if entry is None or entry[1] != weight._version:
        entry = packs[key] = (weight, weight._version, pack(weight, rows))
    return torch.ops.mkl._mkl_linear(x, entry[2], weight, bias, rows)


def _packed_linear_shape(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


_library.impl("packed_linear", _packed_linear, "CPU")
_library.impl("packed_linear", _packed_linear_shape, "Meta")


def routes_to_packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
    """Whether `F.linear(x, weight, bias)` runs on a packed weight: a float32 parameter of at least
    `MIN_PACKED_BYTES` on CPU, a float32 input and a bias of one value per output, outside autograd (the op has no
    backward) and autocast (which would compute in bfloat16)."""
    return (
        _PACKS_FLOAT32
        and isinstance(weight, torch.nn.Parameter)
        and weight.dtype == torch.float32
        and x.dtype == torch.float32
        and weight.dim() == 2
        and x.dim() >= 2
        and (bias is None or (bias.dtype == torch.float32 and bias.shape == weight.shape[:1]))
        and weight.numel() * weight.element_size() >= MIN_PACKED_BYTES
        and x.device.type == "cpu"
        and not torch.is_grad_enabled()
        and not torch.is_autocast_enabled("cpu")
    )


class PackedLinearMode(torch.overrides.TorchFunctionMode):
    """Routes the `F.linear` calls `routes_to_packed_linear` accepts to `torch.ops.lit_rl.packed_linear`. Entered
    inside the compiled decoding step, so the compiled graph calls the op in place of each such weight matmul."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and len(args) >= 2:  # how `nn.Linear.forward` calls it
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if routes_to_packed_linear(x, weight, bias):
                return torch.ops.lit_rl.packed_linear(x, weight, bias)
        return func(*args, **kwargs)
