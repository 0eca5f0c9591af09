"""The rollout engine an on-policy module owns: built on first use (HF decoding on the policy, or vLLM colocated
or as a server), given the policy's weights whenever an optimizer step changed them, and released between
rollouts (sleep mode).

`RolloutEngineOwner` is a mixin of `OnPolicyModule`; it reads the module's `rollout_engine`,
`_engine_weights_step`, `engine_config` (`model.rollout.engine`, which builds the engine), `vllm_config`,
`policy`, `trainer` and `timer`.
"""

from __future__ import annotations

from typing import Optional

import torch

from lit_rl.rollout import RolloutEngine
from lit_rl.rollout.engines.placement import EnginePlacement
from lit_rl.rollout.weights import DEFAULT_BUCKET_MIB, policy_weight_stream
from lit_rl.training.strategies import is_fsdp_wrapped, settle_zero3_parameters


class RolloutEngineOwner:
    """Where an on-policy module's rollouts come from (module docstring)."""

    def engine(self) -> RolloutEngine:
        """The rollout engine, created on first use by `model.rollout.engine` (unless one was injected), holding
        the policy's current weights."""
        if self.rollout_engine is None:
            with self.timer.phase("engine_start"):
                self.rollout_engine = self.build_engine()
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

    def build_engine(self) -> RolloutEngine:
        """A new engine, as `model.rollout.engine` builds it (tests replace this to inject one)."""
        return self.engine_config.build(self)

    def weight_stream(self):
        """The policy's weights as a lazy stream of (name, tensor) buckets, for an engine to load."""
        bucket_mib = getattr(self.engine_config, "push_bucket_mib", DEFAULT_BUCKET_MIB)
        strategy = self.trainer.strategy
        # FSDP: gather from the root (Lightning wraps this module; its flat parameter holds the embeddings).
        wrapped = getattr(strategy, "model", None)
        fsdp_root = wrapped if wrapped is not None and is_fsdp_wrapped(wrapped) else None
        settle_zero3_parameters(strategy)
        return policy_weight_stream(self.policy, int(bucket_mib * 2**20), fsdp_root)

    def engine_dtype(self) -> Optional[torch.dtype]:
        """The dtype the engine computes in (None: not known here, as for a server started with its own
        `--dtype`); HF `generate` samples from the policy itself."""
        return self.engine_config.engine_dtype(self.compute_dtype())

    def engine_numerics_differ(self) -> bool:
        """Whether the engine's log-probs of a token can differ from the trainer's by more than float32 rounding
        (`EngineConfig.numerics_differ`: any vLLM engine but one computing in float32 next to a float32 trainer)."""
        return self.engine_config.numerics_differ(self.compute_dtype())

    def engine_placement(self) -> EnginePlacement:
        """Where this rank's colocated engine lives and which ranks share it
        (`model.rollout.engine.tensor_parallel_size`; 1 for an engine that is not lit-rl's colocated vLLM)."""
        trainer = self.trainer
        return EnginePlacement(
            rank=trainer.global_rank,
            local_rank=trainer.local_rank,
            world_size=trainer.world_size,
            local_world_size=trainer.num_devices,
            tensor_parallel_size=getattr(self.engine_config, "tensor_parallel_size", 1),
        )

    def release_engine(self) -> None:
        """Let the engine release its device memory until it is needed again (vLLM's sleep mode; a no-op for
        engines without one)."""
        sleep = getattr(self.rollout_engine, "sleep", None)
        if callable(sleep):
            sleep()
