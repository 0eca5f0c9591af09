"""The rollout engine an on-policy module owns: built on first use (HF decoding on the policy, or vLLM colocated
or as a server), given the policy's weights whenever an optimizer step changed them, and released between
rollouts (sleep mode).

`RolloutEngineOwner` is a mixin of `OnPolicyModule`; it reads the module's `rollout_engine`,
`_engine_weights_step`, `vllm_config`, `policy`, `tokenizer`, `timer`, `trainer` and `policy_args`.
"""

from __future__ import annotations

from typing import Optional

import torch

from lit_rl.modeling.models import resolve_model_path
from lit_rl.rollout import HFGenerateEngine, RolloutEngine
from lit_rl.rollout.config import VLLM_DTYPES
from lit_rl.rollout.hf import model_eos_token_ids
from lit_rl.rollout.placement import EnginePlacement
from lit_rl.rollout.weights import DEFAULT_BUCKET_MIB, policy_weight_stream
from lit_rl.training.strategies import is_fsdp_wrapped, settle_zero3_parameters


class RolloutEngineOwner:
    """Where an on-policy module's rollouts come from (module docstring)."""

    def engine(self) -> RolloutEngine:
        """The rollout engine, created on first use: HF `generate` on the policy, or vLLM with `model.vllm`
        (unless one was injected), holding the policy's current weights."""
        if self.rollout_engine is None:
            with self.timer.phase("engine_start"):
                self.rollout_engine = self._build_engine()
            self._engine_weights_step = None
        engine = self.rollout_engine
        # Only optimizer steps advance global_step: several generations between two steps push once, unless the
        # engine released its weights in between (sleep mode).
        stale = self._engine_weights_step != self.trainer.global_step or not getattr(engine, "holds_weights", True)
        if engine.needs_weights and stale:
            with self.timer.phase("weight_push"):  # ZeRO-3: gathered a bucket at a time, as the engine loads
                engine.update_weights(self.weight_stream())
            self._engine_weights_step = self.trainer.global_step
        return engine

    def weight_stream(self):
        """The policy's weights as a lazy stream of (name, tensor) buckets, for an engine to load."""
        bucket_mib = self.vllm_config.push_bucket_mib if self.vllm_config else DEFAULT_BUCKET_MIB
        strategy = self.trainer.strategy
        # FSDP: gather from the root (Lightning wraps this module; its flat parameter holds the embeddings).
        wrapped = getattr(strategy, "model", None)
        fsdp_root = wrapped if wrapped is not None and is_fsdp_wrapped(wrapped) else None
        settle_zero3_parameters(strategy)
        return policy_weight_stream(self.policy, int(bucket_mib * 2**20), fsdp_root)

    def _build_engine(self) -> RolloutEngine:
        eos_ids = model_eos_token_ids(self.policy, self.tokenizer.eos_token_id)
        pad_id = self.tokenizer.pad_token_id
        config = self.vllm_config
        if config is None:
            return HFGenerateEngine(self.policy, eos_ids, pad_id, synced_ranks=self.parameters_sharded())
        if config.mode == "server":
            from lit_rl.rollout.server import VLLMServerEngine

            return VLLMServerEngine(config, eos_ids, pad_id)
        from lit_rl.rollout.vllm import VLLMColocateEngine

        return VLLMColocateEngine.start(
            config,
            resolve_model_path(self.policy_args.model_name_or_path),
            dtype=self.compute_dtype(),
            device=self.device,
            eos_token_ids=eos_ids,
            pad_token_id=pad_id,
            placement=self.engine_placement(),
            trust_remote_code=self.policy_args.trust_remote_code,
            phase=lambda name: self.timer.phase(name),  # the current timer (validation swaps it)
        )

    def engine_dtype(self) -> Optional[torch.dtype]:
        """The dtype the vLLM engine computes in: `model.vllm.dtype`, whose `auto` means the trainer's compute dtype
        for a colocated engine and "not known here" for a server (started with its own `--dtype`). None for HF
        `generate`, which samples from the policy itself, and for a server whose dtype is not given."""
        config = self.vllm_config
        if config is None or (config.mode == "server" and config.dtype == "auto"):
            return None
        if config.dtype == "auto":
            return self.compute_dtype()
        return VLLM_DTYPES.get(config.dtype, torch.float32)

    def engine_numerics_differ(self) -> bool:
        """Whether the engine's log-probs of a token can differ from the trainer's by more than float32 rounding:
        any vLLM engine but one computing in float32 next to a float32 trainer (bf16 kernels of two libraries
        round differently even at the same dtype; a server of unknown dtype counts as differing)."""
        if self.vllm_config is None:
            return False
        dtype = self.engine_dtype()
        return dtype is None or dtype != torch.float32 or dtype != self.compute_dtype()

    def engine_placement(self) -> EnginePlacement:
        """Where this rank's colocated engine lives and which ranks share it (`model.vllm.tensor_parallel_size`)."""
        trainer = self.trainer
        return EnginePlacement(
            rank=trainer.global_rank,
            local_rank=trainer.local_rank,
            world_size=trainer.world_size,
            local_world_size=trainer.num_devices,
            tensor_parallel_size=self.vllm_config.tensor_parallel_size,
        )

    def release_engine(self) -> None:
        """Let the engine release its device memory until it is needed again (vLLM's sleep mode; a no-op for
        engines without one)."""
        sleep = getattr(self.rollout_engine, "sleep", None)
        if callable(sleep):
            sleep()
