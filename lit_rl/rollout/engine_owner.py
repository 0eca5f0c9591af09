"""The rollout engine of an on-policy run, as one part: built on first use by `model.rollout.engine` (HF decoding
on the policy, vLLM colocated or as a server, or a user's engine), given the policy's weights whenever an optimizer
step changed them, released between rollouts (sleep mode) and closed at the end.

The producer (`lit_rl.rollout.producer`) samples with it; the module asks it where a colocated engine lives.
"""

from __future__ import annotations

from typing import Optional

from lit_rl.rollout.base import RolloutEngine, SleepingEngine
from lit_rl.rollout.engine_config import EngineConfig
from lit_rl.rollout.engines.placement import EnginePlacement
from lit_rl.rollout.host import RolloutHost
from lit_rl.rollout.weights import policy_weight_stream
from lit_rl.training.strategies import is_fsdp_wrapped, settle_zero3_parameters


class EngineOwner:
    """Holds the run's engine (module docstring).

    Args:
        config: `model.rollout.engine`, which builds the engine (`EngineConfig.build(host)`).
        host: the module that trains the policy (`RolloutHost`).
    """

    def __init__(self, config: EngineConfig, host: RolloutHost) -> None:
        self.config = config
        self.host = host
        self.built: Optional[RolloutEngine] = None  # a plain object, never an nn.Module attribute
        self.weights_step: Optional[int] = None  # the global_step whose weights the engine holds

    def build(self) -> RolloutEngine:
        """A new engine, as `model.rollout.engine` builds it (a test replaces this to inject one)."""
        return self.config.build(self.host)

    def started(self) -> RolloutEngine:
        """The engine, built now when it was not (its weights are not pushed: see `engine`)."""
        if self.built is None:
            with self.host.timer.phase("engine_start"):
                self.built = self.build()
            self.weights_step = None
        return self.built

    def engine(self) -> RolloutEngine:
        """The engine, holding the policy's current weights."""
        engine = self.started()
        global_step = self.host.trainer.global_step
        # Only optimizer steps advance global_step: several generations between two steps push once, unless the
        # engine released its weights in between (sleep mode).
        released = isinstance(engine, SleepingEngine) and not engine.holds_weights
        stale = self.weights_step != global_step or released
        if engine.needs_weights and stale:
            with self.host.timer.phase("weight_push"):  # ZeRO-3: gathered a bucket at a time, as the engine loads
                engine.update_weights(self.weight_stream())
            self.weights_step = global_step
        return engine

    def weights_replaced(self) -> None:
        """The engine's weights are being replaced outside `engine()` (asynchronous rollouts stage versions on it):
        the next `engine()` pushes the current ones again."""
        self.weights_step = None

    def weight_stream(self):
        """The policy's weights as a lazy stream of (name, tensor) buckets, for an engine to load."""
        bucket_mib = self.config.push_bucket_mib
        strategy = self.host.trainer.strategy
        # FSDP: gather from the root (Lightning wraps the module; its flat parameter holds the embeddings).
        wrapped = getattr(strategy, "model", None)
        fsdp_root = wrapped if wrapped is not None and is_fsdp_wrapped(wrapped) else None
        settle_zero3_parameters(strategy)
        return policy_weight_stream(self.host.policy, int(bucket_mib * 2**20), fsdp_root)

    def placement(self) -> EnginePlacement:
        """Where this rank's colocated engine lives and which ranks share it
        (`model.rollout.engine.tensor_parallel_size`; 1 for an engine that is not lit-rl's colocated vLLM)."""
        return EnginePlacement.of(self.host.trainer, self.config.tensor_parallel_size)

    def release(self) -> None:
        """Let the engine release its device memory until it is needed again (vLLM's sleep mode; a no-op for
        engines without one)."""
        if isinstance(self.built, SleepingEngine):
            self.built.sleep()

    def close(self) -> None:
        """Close the engine (processes, memory, files); the next use builds a new one."""
        if self.built is not None:
            self.built.close()
            self.built = None
