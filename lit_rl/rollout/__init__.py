"""Rollout engines: who samples completions. `hf.py` wraps `generate`; `vllm.py` (the only module importing vLLM)
runs an in-process engine; `server.py` talks to a vLLM server over HTTP."""

from lit_rl.rollout.base import RolloutEngine, RolloutOutput, SamplingParams
from lit_rl.rollout.config import VLLMConfig
from lit_rl.rollout.hf import HFGenerateEngine

__all__ = ["HFGenerateEngine", "RolloutEngine", "RolloutOutput", "SamplingParams", "VLLMConfig"]
