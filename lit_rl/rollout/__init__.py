"""Rollout engines: who samples completions. `hf.py` wraps `generate`; `vllm.py` (the only module importing vLLM)
runs an in-process engine, placed by `placement.py`; `server.py` talks to a vLLM server over HTTP; `weights.py`
streams the policy's weights into them, a bucket at a time."""

from lit_rl.rollout.base import RolloutEngine, RolloutOutput, SamplingParams
from lit_rl.rollout.config import VLLMConfig
from lit_rl.rollout.hf import HFGenerateEngine

__all__ = ["HFGenerateEngine", "RolloutEngine", "RolloutOutput", "SamplingParams", "VLLMConfig"]
