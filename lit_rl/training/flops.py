"""Model FLOPs of a training step and the device's peak: `perf/tflops` and `perf/mfu`, every step.

Model FLOPs count the arithmetic the model's math needs, whatever the implementation does (PaLM, appendix B): work
an implementation repeats (a prompt recomputed per completion, padding, activation recomputation) is not counted,
so a faster implementation of the same math shows as a higher utilisation. A token at position p (it attends to
p + 1 keys, itself included) costs in its forward pass

    2 N_mm + 4 L d_attn (p + 1)

- N_mm: the weights of the matrix multiplications it goes through: every linear layer and the output head (an
  embedding lookup multiplies nothing). With LoRA, the frozen weights and the adapters.
- L layers, d_attn = attention heads x head dimension: the scores Q K^T and the weighted sum of V, 2 FLOPs per
  multiply-add each. (Sliding-window attention is counted as full causal attention.)

Its backward pass costs 2 N_mm (the gradients of the inputs) + 2 N_trained (of the weights that train: all of them
in full fine-tuning, the adapters with LoRA) + 8 L d_attn (p + 1). Full fine-tuning then costs the usual
6 N_mm per token, LoRA about 4 N_mm.

What a step counts (`PolicyModule.score_completions` and the algorithms):
- each forward of the policy or the reference model over (prompt, completion) rows, and the backward of the
  policy's training forward: the completion tokens, and each distinct prompt of the rows once;
- generation on the trainer's own devices (HF `generate`, colocated vLLM): the same forward count, for the
  sampled tokens and their prompts (a vLLM server's generation runs elsewhere and is not counted);
- PPO's critic: its value forward, and its forward and backward when it trains.

The peak is the device's dense matmul rate in the compute dtype: from `GPU_PEAKS` by device name, or measured by a
short matmul probe (a CPU, or a GPU missing from the table), once per process.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class ModelShape:
    """What the FLOP count of a causal LM needs (module docstring)."""

    matmul_params: int  # N_mm
    trained_matmul_params: int  # N_trained: the matmul weights that get gradients
    layers: int  # L
    attention_width: int  # d_attn = heads x head_dim

    @classmethod
    def of(cls, model: torch.nn.Module) -> "ModelShape":
        """The shape of a `transformers` causal LM (peft-wrapped or not; its weights may be ZeRO-3-partitioned:
        `ds_numel` is their whole size)."""
        matmul = trained = 0
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if not _is_matmul(module) or weight is None:
                continue
            size = int(getattr(weight, "ds_numel", weight.numel()))
            matmul += size
            trained += size if weight.requires_grad else 0
        config = _text_config(model)
        heads = int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(matmul, trained, int(config.num_hidden_layers), heads * int(head_dim))

    def forward_flops(self, tokens: float, keys: float) -> float:
        """Forward FLOPs of `tokens` tokens that attend to `keys` keys in all (the sum of p + 1 over them)."""
        return 2.0 * self.matmul_params * tokens + 4.0 * self.layers * self.attention_width * keys

    def backward_flops(self, tokens: float, keys: float) -> float:
        """Backward FLOPs of the same tokens: the inputs' gradients, the trained weights' gradients, attention."""
        matmuls = 2.0 * (self.matmul_params + self.trained_matmul_params) * tokens
        return matmuls + 8.0 * self.layers * self.attention_width * keys


def _is_matmul(module: torch.nn.Module) -> bool:
    # transformers' Conv1D (GPT-2 style) is a linear layer with its weight transposed.
    return isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"


def _text_config(model: torch.nn.Module):
    config = model.config
    return getattr(config, "text_config", None) or config


def row_tokens_and_keys(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_mask: torch.Tensor
) -> tuple[float, float]:
    """(tokens, keys) a forward of these rows needs: each distinct prompt once (its P tokens attend to
    P (P + 1) / 2 keys), and each row's completion tokens after its prompt (token t of a completion after a prompt
    of P tokens attends to P + t + 1 keys).

    prompt_ids, prompt_mask: [N, P], left-padded; completion_mask: [N, T], 1 on the completion's tokens (from its
    start, so a row's count is its length).
    """
    prompt_lengths = prompt_mask.sum(dim=1).double()  # [N]
    completion_lengths = completion_mask.gt(0).sum(dim=1).double()  # [N]
    distinct = prompt_lengths[_first_of_each_distinct_row(prompt_ids.masked_fill(prompt_mask == 0, -1))]
    tokens = distinct.sum() + completion_lengths.sum()
    keys = (distinct * (distinct + 1) / 2).sum()
    keys = keys + (completion_lengths * (prompt_lengths + 1) + completion_lengths * (completion_lengths - 1) / 2).sum()
    return float(tokens), float(keys)


def _first_of_each_distinct_row(rows: torch.Tensor) -> torch.Tensor:
    """The index of the first occurrence of each distinct row of `rows` [N, P]."""
    unique, inverse = torch.unique(rows, dim=0, return_inverse=True)
    positions = torch.arange(len(rows), device=rows.device)
    first = torch.full((len(unique),), len(rows), dtype=torch.long, device=rows.device)
    return first.scatter_reduce(0, inverse, positions, reduce="amin")


# Dense (no sparsity) peak matmul FLOP/s by device name, as the vendors' data sheets give them: bfloat16/float16
# on tensor cores, float32 with TF32 tensor cores (used when `torch.get_float32_matmul_precision()` is not
# "highest"), and plain float32. Checked in order: the first name contained in the device's name wins.
GPU_PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H100 PCIe", {"bf16": 756e12, "tf32": 378e12, "fp32": 51.2e12}),
    ("H100 NVL", {"bf16": 835e12, "tf32": 418e12, "fp32": 60e12}),
    ("H100", {"bf16": 989e12, "tf32": 495e12, "fp32": 67e12}),  # SXM
    ("H200", {"bf16": 989e12, "tf32": 495e12, "fp32": 67e12}),
    ("GH200", {"bf16": 989e12, "tf32": 495e12, "fp32": 67e12}),
    ("A100", {"bf16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    ("L40S", {"bf16": 362e12, "tf32": 183e12, "fp32": 91.6e12}),
    ("L4", {"bf16": 121e12, "tf32": 60e12, "fp32": 30.3e12}),
)


@dataclass(frozen=True)
class Peak:
    flops: float  # per device, FLOP/s
    source: str  # where the number comes from, for the summary: "H100 data sheet, bf16", "measured cpu matmul, float32"


def dtype_key(dtype: torch.dtype) -> str:
    if dtype in (torch.bfloat16, torch.float16):
        return "bf16"
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def gpu_peaks(device_name: str) -> Optional[tuple[str, dict[str, float]]]:
    """The `GPU_PEAKS` entry (its name, its peaks) of a GPU by its device name; None for one not in the table."""
    return next(((known, peaks) for known, peaks in GPU_PEAKS if known in device_name), None)


def device_peak(device: torch.device, dtype: torch.dtype) -> Peak:
    """The peak dense matmul rate of `device` in `dtype`: the table's for a known GPU, else measured."""
    known = gpu_peaks(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    if known is not None:
        name, peaks = known
        return Peak(peaks[dtype_key(dtype)], f"{name} data sheet, {dtype_key(dtype)}")
    if device.type == "cpu":
        return cpu_matmul_peak(dtype)
    return Peak(measured_matmul_flops(device.type, dtype), f"measured {device.type} matmul, {_name(dtype)}")


def native_reduced_precision(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies `dtype` (bf16, fp16) in instructions of its own (AVX-512 BF16/FP16, AMX), as
    oneDNN reports it."""
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


def cpu_matmul_peak(dtype: torch.dtype, seconds: float = 0.05) -> Peak:
    """The peak of a CPU matmul in `dtype` that utilisation divides by, and what was measured: the rate in `dtype`,
    or on a CPU without instructions for `dtype` (bf16 or fp16) the float32 rate when that is higher. Such a CPU
    converts: a large `torch.mm` in bf16 ran at 0.0007 TFLOP/s on an AVX2 AMD EPYC against 0.07 in float32, while a
    model's bf16 linear layers reached 0.003, four times the bf16 probe; no bf16 work outruns the float32 units."""
    measured = Peak(measured_matmul_flops("cpu", dtype, seconds=seconds), f"measured cpu matmul, {_name(dtype)}")
    if dtype not in (torch.bfloat16, torch.float16) or native_reduced_precision(dtype):
        return measured
    float32 = measured_matmul_flops("cpu", torch.float32, seconds=seconds)
    if float32 <= measured.flops:
        return measured
    return Peak(float32, f"measured cpu matmul, float32: no {_name(dtype)} unit")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def measured_matmul_flops(device_type: str, dtype: torch.dtype, size: int = 1536, seconds: float = 0.05) -> float:
    """The best rate of square matmuls in `dtype` on this device over about `seconds` (after one warm-up): what a
    large, well-shaped matmul reaches here, with the threads torch uses. Measured once per process for each
    (device, dtype, size, seconds), however the arguments are spelled.

    The matrices are `size` x `size`, or smaller where one matmul would take more than `seconds` / 4: a CPU without
    bfloat16 instructions multiplies two 1536 x 1536 bf16 matrices in 10 s, which every bf16-mixed run on it
    paid twice before its first step; 256 is already well-shaped there (0.05 s at 0.7 GFLOP/s)."""
    return _measured_matmul_flops(device_type, dtype, size, seconds)


@functools.cache
def _measured_matmul_flops(device_type: str, dtype: torch.dtype, size: int, seconds: float) -> float:
    device = torch.device(device_type)
    # Its own generator: the probe runs after `seed_everything`, and must leave the run's random stream alone.
    generator = torch.Generator(device=device).manual_seed(0)
    side = min(size, 256)
    while True:
        a = torch.randn(side, side, device=device, generator=generator).to(dtype)
        b = torch.randn(side, side, device=device, generator=generator).to(dtype)
        elapsed = _timed_mm(a, b, device)  # the warm-up: kernels chosen, memory touched
        if side >= size or elapsed > seconds / 4:
            break
        side = min(size, side * 2)
    best, spent = 0.0, 0.0
    while spent < seconds:
        elapsed = _timed_mm(a, b, device)
        spent += elapsed
        best = max(best, 2.0 * side**3 / elapsed)
    return best


def _timed_mm(a: torch.Tensor, b: torch.Tensor, device: torch.device) -> float:
    _synchronize(device)
    start = time.perf_counter()
    torch.mm(a, b)
    _synchronize(device)
    return time.perf_counter() - start


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def precision_advice(device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """One line when the compute dtype is a slow choice on this device (None otherwise): bf16 or fp16 on a CPU whose
    measured bf16 matmuls are slower than its fp32 ones (no bf16 instructions), or fp32 on a GPU with bf16."""
    if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        low, full = measured_matmul_flops("cpu", dtype), measured_matmul_flops("cpu", torch.float32)
        if low < full:
            return (
                f"trainer.precision: {_name(dtype)} matmuls run at {low / 1e9:.3g} GFLOP/s on this CPU against "
                f"{full / 1e9:.3g} in float32 (it has no {_name(dtype)} instructions): 32-true is faster here"
            )
    if device.type == "cuda" and dtype == torch.float32 and torch.cuda.is_bf16_supported():
        name = torch.cuda.get_device_name(device)
        known = gpu_peaks(name)
        gain = f" (its matmul peak is {known[1]['bf16'] / known[1][dtype_key(dtype)]:.3g}x float32's)" if known else ""
        return (
            f"trainer.precision: float32 on {name}, which computes in bfloat16{gain}: "
            "--config configs/precision/bf16.yaml (bf16-mixed) is faster"
        )
    return None


@dataclass
class RunThroughput:
    """The run's totals for the end-of-run summary: optimizer steps, their seconds (the slowest rank's) and model
    FLOPs (all ranks'), and the peak they are measured against. The engine's start (`perf/engine_start_s`: a vLLM
    server launched and waited for, once) is kept apart: it is no part of the run's speed."""

    steps: int = 0
    seconds: float = 0.0
    flops: float = 0.0
    peak: Optional[Peak] = None
    devices: int = 1
    engine_start_s: float = 0.0

    def add(self, seconds: float, flops: float, engine_start_s: float = 0.0) -> None:
        """One step of `seconds`, of which `engine_start_s` started the engine (left out of the speed)."""
        self.steps, self.flops = self.steps + 1, self.flops + flops
        self.seconds += max(seconds - engine_start_s, 0.0)
        self.engine_start_s += engine_start_s

    def rates(self, seconds: float, flops: float) -> tuple[float, Optional[float]]:
        """TFLOP/s of `flops` model FLOPs in `seconds`, and that rate's share of the devices' peak (None without
        a peak): a step's, or the run's (`tflops`, `mfu`)."""
        tflops = flops / seconds / 1e12 if seconds > 0 else 0.0
        return tflops, None if self.peak is None else tflops * 1e12 / (self.peak.flops * self.devices)

    def tflops(self) -> float:
        return self.rates(self.seconds, self.flops)[0]

    def mfu(self) -> Optional[float]:
        return self.rates(self.seconds, self.flops)[1]

    def summary(self) -> str:
        """`0.141 s/step, 0.0311 TFLOP/s, MFU 8.67% (of measured cpu matmul, float32 peak 0.358 TFLOP/s)`."""
        if not self.steps:
            return ""
        line = f"{self.seconds / self.steps:.3g} s/step, {self.tflops():.3g} TFLOP/s"
        mfu = self.mfu()
        if mfu is not None and self.peak is not None:
            devices = f" x {self.devices} devices" if self.devices > 1 else ""
            line += f", MFU {100 * mfu:.3g}% (of {self.peak.source} peak {self.peak.flops / 1e12:.3g} TFLOP/s{devices})"
        if self.engine_start_s >= 0.05:  # a launched server's wait: said, not averaged into the steps
            line += f"; the engine's start ({self.engine_start_s:.3g} s) left out"
        return line
