"""Rollout engines: who samples completions. `hf.py` wraps `generate`; vLLM engines live in their own module."""

from lit_rl.rollout.base import RolloutEngine, RolloutOutput, SamplingParams
from lit_rl.rollout.hf import HFGenerateEngine

__all__ = ["HFGenerateEngine", "RolloutEngine", "RolloutOutput", "SamplingParams"]
