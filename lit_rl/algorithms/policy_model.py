"""The policy's model and its reference, for `PolicyModule` (`lit_rl.algorithms.base`): loading with the run's
options (in `configure_model`, so strategies that shard can build it in place), the LoRA adapter, `torch.compile`,
and the frozen reference (a loaded copy, or the policy with its adapter off)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
from lightning.pytorch.strategies import FSDPStrategy

from lit_rl.config import PolicyArgs
from lit_rl.errors import ConfigError
from lit_rl.modeling.lora import LoRAConfig, adapter_layers, apply_lora, reference_view, reset_adapter
from lit_rl.modeling.models import load_causal_lm
from lit_rl.training.flops import ModelShape
from lit_rl.training.strategies import gathered_parameters, hf_zero3_loading


class PolicyModel:
    """A mixin of `PolicyModule`: the attributes below are the module's (set in its `__init__`); also its
    `head_chunk_tokens`, `attached_strategy()` and `parameters_sharded()`."""

    policy_args: PolicyArgs
    policy: Optional[torch.nn.Module]
    ref_model: Optional[torch.nn.Module]
    random_init: bool
    disable_dropout: bool
    policy_shape: Optional[ModelShape]
    tokenizer: Any

    def load_model(self, random_init: bool = False, path: Optional[str] = None) -> torch.nn.Module:
        """The policy's model (or the one at `path`, e.g. a reference) with this module's loading options."""
        args = self.policy_args
        model = load_causal_lm(
            path or args.model_name_or_path,
            dtype=args.dtype,
            random_init=random_init,
            gradient_checkpointing=args.gradient_checkpointing,
            trust_remote_code=args.trust_remote_code,
            attn_implementation=args.attn_implementation,
            disable_dropout=self.disable_dropout,
        )
        if len(self.tokenizer) > model.get_input_embeddings().num_embeddings:  # a pad token was added
            model.resize_token_embeddings(len(self.tokenizer))
        return model

    @property
    def lora_config(self) -> Optional[LoRAConfig]:
        """`model.policy.lora`: train a LoRA adapter instead of the full weights (None: full fine-tuning)."""
        return self.policy_args.lora

    def reference_is_adapter_off(self, path: Optional[str] = None) -> bool:
        """Whether the reference (the model at `path`, default the starting policy) is the policy with its LoRA
        adapter disabled, so that no second copy of the weights is loaded. Raises when training biases (which
        disabling the adapter does not undo) would make that reference differ from the starting model."""
        lora = self.lora_config
        adapter_off = lora is not None and path in (None, self.policy_args.model_name_or_path)
        if adapter_off and lora.bias != "none":
            raise ConfigError(
                f"model.policy.lora.bias={lora.bias!r} trains biases, which disabling the adapter does not undo: the "
                "reference model would drift from the starting policy (use bias: none)"
            )
        return adapter_off

    @contextmanager
    def reference_model(self) -> Iterator[torch.nn.Module]:
        """The model that gives reference log-probs: the frozen copy, or with LoRA the policy, adapter disabled."""
        if self.ref_model is not None:
            yield self.ref_model
        elif self.reference_is_adapter_off():
            with reference_view(self.policy):
                yield self.policy
        else:
            raise RuntimeError("no reference model was loaded")

    def load_reference(self, path: Optional[str] = None, whole: bool = False) -> torch.nn.Module:
        """A frozen copy of the model at `path` (default: the starting policy), in eval mode (under ZeRO-3 it is
        partitioned like the policy and never given to the optimizer, unless `whole`: a copy run outside the
        engine, which nothing would gather)."""
        with hf_zero3_loading(None if whole else self.attached_strategy()):
            return self.load_model(path=path).eval().requires_grad_(False)

    def configure_model(self) -> None:
        if self.head_chunk_tokens is not None and isinstance(self.attached_strategy(), FSDPStrategy):
            raise ConfigError(
                "model.policy.head_chunk_tokens is not supported with FSDP yet (the head runs outside the wrapped "
                "model's forward, which FSDP must unshard); use DeepSpeed ZeRO-3 or drop the option"
            )
        if self.policy is None:
            # from_pretrained returns eval mode; Lightning switches modes around validation, start in train mode.
            with hf_zero3_loading(self.attached_strategy()):
                self.policy = self.load_model(random_init=self.random_init).train()
                if self.lora_config is not None:
                    self._add_lora_adapter()
        if self.policy_shape is None:
            self.policy_shape = ModelShape.of(self.policy)
        if self.policy_args.compile:
            self._compile_policy()

    def _compile_policy(self) -> None:
        """`model.policy.compile`: every call of the policy runs through `torch.compile` (in place, so parameter
        names, checkpoints and the weights engines are given stay the same)."""
        if self.parameters_sharded():
            raise ConfigError(
                "model.policy.compile=true needs each rank to hold whole weights; this strategy shards them "
                "(ZeRO-3, FSDP): use DDP or ZeRO-2, or leave compile off"
            )
        self.policy.compile()

    def _add_lora_adapter(self) -> None:
        """Wrap the policy with a new LoRA adapter, initialised from the run's seed alone: the same under every
        strategy, and leaving the global RNG stream (which validation sampling draws from) where it was."""
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            self.policy = apply_lora(self.policy, self.lora_config)
            torch.manual_seed(torch.initial_seed())
            for layer in adapter_layers(self.policy):
                # Under ZeRO-3 `configure_model` runs inside `deepspeed.zero.Init`: the adapters were partitioned
                # as they were created, before peft could set B = 0. Initialise them whole (elsewhere a no-op).
                with gathered_parameters(layer, modifier_rank=0):
                    reset_adapter(layer)
