"""The policy's weights as a rollout engine loads them: by Hugging Face name, gathered a bucket at a time.

Under ZeRO-3 every rank holds a slice of each parameter. Gathering the whole model at once for a push puts a
second full copy of it on every rank (in fp32 for a 7B model: 28 GB), the out-of-memory users of other trainers
meet. `policy_weight_stream` instead walks the model in blocks (each item of a `ModuleList`, i.e. a decoder
layer, is one block; so is each other module with weights of its own), packs consecutive blocks into buckets of
at most `bucket_bytes` (a block larger than that is a bucket alone), gathers one bucket, yields its tensors,
and releases it before the next. A consumer that finishes with each tensor as it goes (vLLM's `reload_weights`
loads layer by layer) then holds at most about one bucket of gathered weights. Blocks are never split across
buckets, so a layer that vLLM fuses (q/k/v, gate/up) arrives whole within one bucket.

With a LoRA policy, each adapted layer yields its merged weight `W + (alpha / r) B A` (`lit_rl.modeling.lora`), computed
from the gathered bucket; adapter tensors never leave. Tied weights are yielded once (under the first name).

FSDP: the whole model is gathered once (`summon_full_params`), as before; bucketing is for ZeRO-3. The names of
wrapped modules lose FSDP's (and activation checkpointing's) wrapper segments, and FSDP's own flat parameters are
left out: what remains are the plain model's names.
"""

from __future__ import annotations

import re
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from lit_rl.modeling.lora import base_model, hf_weight_name, is_lora_layer, is_lora_model, lora_delta
from lit_rl.training.compat import persistent_buffers
from lit_rl.training.strategies import gathered_parameters, gathered_parameters_of, is_fsdp_wrapped

_WRAPPER_SEGMENT = re.compile(r"(_fsdp_wrapped_module|_checkpoint_wrapped_module|_orig_mod)\.")
_FLAT_PARAM = "_flat_param"


def plain_name(key: str) -> Optional[str]:
    """A parameter's key in a model wrapped by FSDP, activation checkpointing or `torch.compile` -> its key in the
    plain model; None for FSDP's flat parameter, which the plain model does not have."""
    if key.rsplit(".", 1)[-1] == _FLAT_PARAM:
        return None
    return _WRAPPER_SEGMENT.sub("", key)


@dataclass
class WeightBlock:
    """Weights that go to the engine together: a module's own tensors, or (`whole`) everything under it."""

    path: str
    module: torch.nn.Module
    whole: bool
    parameters: list[torch.nn.Parameter]

    @property
    def full_bytes(self) -> int:
        """Bytes once gathered (a ZeRO-3 parameter's `numel()` is its local slice; `ds_numel` the whole)."""
        return sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in self.parameters)

    def named_tensors(self, merge_lora: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """The block's tensors by the plain model's names (call with its parameters gathered); with
        `merge_lora`, each LoRA layer's weight merged with its adapter and the adapter tensors left out."""
        modules = list(self.module.named_modules(prefix=self.path)) if self.whole else [(self.path, self.module)]
        deltas = {}
        if merge_lora:
            with torch.no_grad():
                for path, module in modules:
                    delta = lora_delta(module)
                    if delta is not None:
                        deltas[f"{path}.base_layer.weight"] = delta
        own = {id(p) for p in self.parameters}
        for path, module in modules:
            own_here = module.named_parameters(recurse=False, remove_duplicate=False)  # an alias under each name
            tensors = [(name, p) for name, p in own_here if id(p) in own]
            tensors += persistent_buffers(module)
            for name, tensor in tensors:
                key = f"{path}.{name}" if path else name
                plain = plain_name(key)
                hf_name = hf_weight_name(plain) if merge_lora and plain is not None else plain
                if hf_name is None:
                    continue
                value = tensor.detach()
                if key in deltas:
                    value = value + deltas[key].to(value.dtype)
                yield hf_name, value


def weight_blocks(model: torch.nn.Module) -> list[WeightBlock]:
    """The policy's weights in model order, cut into blocks (see the module docstring)."""
    base = base_model(model)
    lora = is_lora_model(model)
    blocks: list[WeightBlock] = []

    def add(path: str, module: torch.nn.Module, whole: bool) -> None:
        # A tied weight is in the block of every module that holds it (gathered again there): vLLM expects it
        # under each name (its loader counts the tied head's weight as loaded only when it arrives by that name).
        params = list(module.parameters(recurse=whole))
        has_buffers = any(persistent_buffers(m) for m in (module.modules() if whole else [module]))
        if params or has_buffers:
            blocks.append(WeightBlock(path, module, whole, params))

    def visit(path: str, module: torch.nn.Module) -> None:
        if isinstance(module, torch.nn.ModuleList):
            for name, child in module.named_children():
                add(f"{path}.{name}" if path else name, child, whole=True)
            return
        if lora and is_lora_layer(module):
            add(path, module, whole=True)  # its weight and adapters merge into one tensor
            return
        add(path, module, whole=False)
        for name, child in module.named_children():
            visit(f"{path}.{name}" if path else name, child)

    visit("", base)
    # A LoRA layer inside a block (a decoder layer) is handled there: `named_tensors` merges each one it meets.
    return blocks


def buckets(blocks: list[WeightBlock], bucket_bytes: int) -> list[list[WeightBlock]]:
    """Consecutive blocks packed into buckets of at most `bucket_bytes` (a larger block is a bucket alone)."""
    out: list[list[WeightBlock]] = []
    size = 0
    for block in blocks:
        if out and size + block.full_bytes <= bucket_bytes:
            out[-1].append(block)
            size += block.full_bytes
        else:
            out.append([block])
            size = block.full_bytes
    return out


def policy_weight_stream(
    model: torch.nn.Module,
    bucket_bytes: int,
    fsdp_root: Optional[torch.nn.Module] = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights by Hugging Face name, gathered one bucket at a time (a collective under ZeRO-3 and
    FSDP: every rank must consume its stream, in step). A tensor is valid until the stream moves past its bucket;
    a consumer that keeps one longer keeps that bucket's memory alive.

    `fsdp_root`: under FSDP, the outermost FSDP module (Lightning wraps the LightningModule itself, whose flat
    parameter holds the weights not in a wrapped layer: the embeddings, the final norm)."""
    merge_lora = is_lora_model(model)
    root = fsdp_root if fsdp_root is not None else model
    whole_model = gathered_parameters(root) if is_fsdp_wrapped(root) else nullcontext()
    with whole_model:
        for bucket in buckets(weight_blocks(model), bucket_bytes):
            with gathered_parameters_of([p for block in bucket for p in block.parameters]):
                for block in bucket:
                    yield from block.named_tensors(merge_lora)
