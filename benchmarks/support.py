"""What the benchmarks share and the library does not need: random models of a given shape, the whole policy's
weights at once (the baseline the streamed push is measured against) and parameter counts.

Scripts import it as `from support import ...` (each puts `benchmarks/` on `sys.path`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lit_rl.modeling.lora import is_lora_model, merged_weights
from lit_rl.modeling.models import build_char_tokenizer, tiny_qwen2_config


def build_random_model(out_dir: str | Path, seed: int = 0, **sizes: Any) -> Path:
    """A randomly initialised Qwen2 of `tiny_qwen2_config(**sizes)` with the tiny tokenizer, saved at `out_dir`
    (benchmark models of other sizes, built offline)."""
    from transformers import Qwen2ForCausalLM

    out = Path(out_dir)
    torch.manual_seed(seed)
    Qwen2ForCausalLM(tiny_qwen2_config(**sizes)).save_pretrained(out)
    build_char_tokenizer().save_pretrained(out)
    return out


def policy_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """All of the policy's weights at once, by Hugging Face name, detached: what a push without streaming sends
    (a LoRA policy gives its merged weights)."""
    if is_lora_model(model):
        return merged_weights(model)
    return [(name, tensor.detach()) for name, tensor in model.state_dict().items()]


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())
