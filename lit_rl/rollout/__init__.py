"""Rollout engines: who samples completions. `engine_config.py` holds the choice a run makes
(`model.rollout.engine`: `HFGenerate`, `VLLMColocate`, `VLLMServer`, or a user's); `hf.py` wraps `generate`;
`vllm.py` (the trainer imports vLLM nowhere
else, but for `nccl` transfers) runs an in-process engine, placed by `placement.py`; `server.py` talks to vLLM
servers over HTTP, with the weights as files, uploads (`weight_receiver.py`) or broadcasts
(`collective_transfer.py`, whose gloo engine `vllm_transfer_plugin.py` runs inside the server); `weights.py`
streams the policy's weights, a bucket at a time."""

from lit_rl.rollout.base import RolloutEngine, RolloutOutput, SamplingParams
from lit_rl.rollout.config import VLLMConfig
from lit_rl.rollout.engine_config import EngineConfig, HFGenerate, VLLMColocate, VLLMServer, WeightTransfer
from lit_rl.rollout.hf import HFGenerateEngine

__all__ = [
    "EngineConfig",
    "HFGenerate",
    "HFGenerateEngine",
    "RolloutEngine",
    "RolloutOutput",
    "SamplingParams",
    "VLLMColocate",
    "VLLMConfig",
    "VLLMServer",
    "WeightTransfer",
]
