"""LoRA adapters with the `peft` library: the one module that imports peft.

With `model.policy.lora` set (`--config configs/peft/lora.yaml`), the policy is the loaded model wrapped by
`peft.get_peft_model`: its weights are frozen and only the low-rank matrices (and `modules_to_save`) train.

- The reference model of GRPO/RLOO/Online DPO/DPO is the same model with the adapter disabled
  (`reference_view`): the starting weights, without a second copy of them in memory.
- Rollout engines that hold their own weights (vLLM) receive the merged weights `W + (alpha / r) B A` under the
  base model's Hugging Face names (`merged_weights`). They are computed next to the frozen weights, not merged
  into them in place: merging and unmerging round `W` in floating point, so the frozen weights would drift.
- Lightning checkpoints keep only what trains (`trainable_keys`); the frozen weights are reloaded from
  `model_name_or_path` when a checkpoint is loaded. (DeepSpeed writes its own checkpoint directories, frozen
  weights included.)
"""

from __future__ import annotations

import re
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, ContextManager, Iterator, Optional

import torch

from lit_rl.errors import ConfigError

# The attention and MLP projections of Qwen2/Llama/Mistral-style models.
DEFAULT_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_BIASES = ("none", "all", "lora_only")


@dataclass
class LoRAConfig:
    """LoRA settings (`model.policy.lora`): the adapted weight is `W + (alpha / r) B A`, with A [r, in], B [out, r].

    Args:
        r: rank of the adapter.
        alpha: scaling numerator; the update is scaled by `alpha / r`.
        dropout: dropout on the adapter's input. Keep 0 for RL: the trainer compares log-probs of the same tokens
            under the same weights, which dropout makes differ.
        target_modules: module names (suffixes) that get an adapter; default: the attention and MLP projections
            of Qwen2/Llama-style models. `all-linear` adapts every linear layer but the output head.
        modules_to_save: modules that stay fully trainable (and are saved whole), e.g. `[lm_head]` of a model
            whose embeddings are not tied (with tied embeddings the input embedding and head are rejected here).
        bias: which biases train: `none`, `all` or `lora_only`.
    """

    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGET_MODULES))
    modules_to_save: Optional[list[str]] = None
    bias: str = "none"


def as_lora_config(value: Any) -> Optional[LoRAConfig]:
    """`model.policy.lora` as given (a LoRAConfig, a dict from an older checkpoint's hyper-parameters, or None)."""
    if value is None or isinstance(value, LoRAConfig):
        return value
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(LoRAConfig.__dataclass_fields__))
        if unknown:
            raise ConfigError(
                f"model.policy.lora has no key {unknown[0]!r} (keys: {sorted(LoRAConfig.__dataclass_fields__)})"
            )
        return LoRAConfig(**value)
    raise ConfigError(f"model.policy.lora must be a mapping of LoRA settings, got {value!r}")


def check_lora_config(config: Optional[LoRAConfig]) -> None:
    """Reject impossible settings at construction, naming the key; and a missing `peft` install."""
    if config is None:
        return
    if config.r < 1:
        raise ConfigError(f"model.policy.lora.r must be >= 1, got {config.r}")
    if not config.alpha > 0:
        raise ConfigError(f"model.policy.lora.alpha must be > 0, got {config.alpha}")
    if not 0.0 <= config.dropout < 1.0:
        raise ConfigError(f"model.policy.lora.dropout must be in [0, 1), got {config.dropout}")
    if config.bias not in _BIASES:
        raise ConfigError(f"model.policy.lora.bias must be one of {list(_BIASES)}, got {config.bias!r}")
    if not config.target_modules:
        raise ConfigError("model.policy.lora.target_modules must name at least one module")
    try:
        import peft  # noqa: F401
    except ImportError as err:
        raise ConfigError(f"model.policy.lora needs the peft library ({err}): pip install -e '.[peft]'") from None


def apply_lora(model: torch.nn.Module, config: LoRAConfig) -> torch.nn.Module:
    """Wrap `model` with a fresh LoRA adapter (peft initialises B = 0, so the output is unchanged at first)."""
    import peft

    _check_tied_embeddings(model, config)
    target: Any = config.target_modules
    if target == ["all-linear"]:
        target = "all-linear"
    peft_config = peft.LoraConfig(
        r=config.r,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=target,
        modules_to_save=config.modules_to_save,
        bias=config.bias,
        task_type="CAUSAL_LM",
    )
    try:
        wrapped = peft.get_peft_model(model, peft_config)
    except ValueError as err:  # e.g. "Target modules {...} not found in the base model"
        raise ConfigError(f"model.policy.lora.target_modules={config.target_modules}: {err}") from None
    # (Gradient checkpointing needs nothing more: transformers checkpoints non-reentrantly, so adapters inside a
    # checkpointed block get gradients although the frozen embeddings' outputs need none.)
    return wrapped


def _check_tied_embeddings(model: torch.nn.Module, config: LoRAConfig) -> None:
    """Reject adapting or training the input embedding or output head of a model that ties them: the trained one
    would part from its twin, and loaders that tie them again (vLLM) would silently drop the change."""
    if not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        return
    embeddings = (model.get_input_embeddings(), model.get_output_embeddings())
    names = {name for name, module in model.named_modules() if any(module is e for e in embeddings)}
    names |= {name.rsplit(".", 1)[-1] for name in names}
    asked = set(config.target_modules) | set(config.modules_to_save or [])
    clash = sorted(asked & names)
    if clash:
        raise ConfigError(
            f"model.policy.lora names {clash}, but the model ties its input and output embeddings "
            "(tie_word_embeddings): "
            "adapting or training one of them alone would untie them; leave them out of target_modules and "
            "modules_to_save"
        )


def adapter_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules peft put an adapter into."""
    from peft.tuners.lora import LoraLayer

    return [module for module in model.modules() if isinstance(module, LoraLayer)]


def reset_adapter(layer: torch.nn.Module) -> None:
    """Initialise `layer`'s adapters as peft does when it creates them (A random, B = 0)."""
    for name in list(layer.lora_A) + list(layer.lora_embedding_A):
        layer.reset_lora_parameters(name, init_lora_weights=True)


def is_lora_model(model: Optional[torch.nn.Module]) -> bool:
    """Whether `model` is a peft model (duck-typed, so callers need not import peft)."""
    return model is not None and hasattr(model, "disable_adapter") and hasattr(model, "get_base_model")


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The `transformers` model under a peft wrapper (the model itself otherwise)."""
    return model.get_base_model() if is_lora_model(model) else model


def reference_view(model: torch.nn.Module) -> ContextManager[None]:
    """Inside it, `model` computes with its adapters disabled: the frozen starting weights."""
    return model.disable_adapter() if is_lora_model(model) else nullcontext()


_ADAPTER_KEY = re.compile(r"\.(lora_[A-Za-z_]+|original_module)\.")
_WRAPPED_KEY = re.compile(r"\.(base_layer|modules_to_save\.[^.]+)\.")


def merged_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The weights a plain `transformers` model of the base architecture would have with the adapter merged in,
    by their Hugging Face names (what vLLM's `load_weights` and `save_pretrained` expect), detached.

    `W' = W + delta`, with peft's own `get_delta_weight` (`(alpha / r) B A`, transposed for fan-in-fan-out
    layers) summed over the active adapters; a module in `modules_to_save` contributes its trained copy.
    """
    with torch.no_grad():
        return _merged_weights(base_model(model))


def _merged_weights(base: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    deltas = {f"{path}.base_layer.weight": lora_delta(module) for path, module in base.named_modules()}
    weights = []
    for key, tensor in base.state_dict().items():
        name = hf_weight_name(key)
        if name is not None:
            delta = deltas.get(key)
            weights.append((name, tensor.detach() if delta is None else tensor.detach() + delta.to(tensor.dtype)))
    return weights


@contextmanager
def merged_view(model: torch.nn.Module) -> Iterator[None]:
    """Inside it, `model` computes with its adapters merged into its weights, as an engine holding its own
    weights does (vLLM): each adapted layer's weight is `W + delta` rounded to W's dtype (the tensors
    `merged_weights` gives), and peft's adapter branch is off. On exit every `W` is restored bit for bit (from a
    copy, not by subtracting `delta` again, which would round). Nothing happens to a model without adapters."""
    if not is_lora_model(model):
        yield
        return
    saved = []  # (layer, its weight, the weight's original values)
    try:
        with torch.no_grad():
            for module in base_model(model).modules():
                delta = lora_delta(module)
                if delta is None:
                    continue
                weight = module.get_base_layer().weight
                saved.append((module, weight, weight.detach().clone()))
                weight.add_(delta.to(weight.dtype))
                module.merged_adapters = list(module.active_adapters)  # peft then runs the base layer alone
        yield
    finally:
        with torch.no_grad():
            for module, weight, original in saved:
                weight.copy_(original)
                module.merged_adapters = []


def lora_delta(module: torch.nn.Module) -> Optional[torch.Tensor]:
    """`(alpha / r) B A` of a LoRA layer (peft's `get_delta_weight`, summed over its active adapters), to add to
    its `base_layer.weight`; None for any other module, or a layer whose adapter is merged already."""
    from peft.tuners.lora import LoraLayer

    if not isinstance(module, LoraLayer) or module.merged:
        return None
    adapters = [name for name in module.active_adapters if name in module.lora_A or name in module.lora_embedding_A]
    return sum(module.get_delta_weight(name) for name in adapters) if adapters else None


def is_lora_layer(module: torch.nn.Module) -> bool:
    """Whether peft put an adapter into `module` (its weights merge as one: see `lora_delta`)."""
    from peft.tuners.lora import LoraLayer

    return isinstance(module, LoraLayer)


def hf_weight_name(key: str) -> Optional[str]:
    """A state-dict key of a (peft-wrapped) model -> the plain model's name; None for adapter keys and the
    frozen originals of `modules_to_save`, which the plain model does not have."""
    return None if _ADAPTER_KEY.search(key) else _WRAPPED_KEY.sub(".", key)


def trainable_keys(module: torch.nn.Module) -> set[str]:
    """State-dict keys of `module`'s parameters that train (with LoRA: the adapters and `modules_to_save`)."""
    return {name for name, param in module.named_parameters() if param.requires_grad}


def save_merged(model: torch.nn.Module, out_dir: Any) -> None:
    """`save_pretrained` of the base architecture with the adapter merged in: loadable without peft (and by vLLM)."""
    merged = dict(merged_weights(model))
    base_model(model).save_pretrained(out_dir, state_dict=merged, safe_serialization=True)
