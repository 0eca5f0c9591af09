"""Where completions come from. `engine_config.py` holds the choice a run makes (`model.rollout.engine`:
`HFGenerate`, `VLLMColocate`, `VLLMServer`, or a user's); `base.py` the interface every engine implements.

- `engines/`: the engines (`hf`, `vllm` colocated, `vllm_server`), one module each.
- `server/`: the trainer's side of vLLM servers (client, pool, weight transports); imports no vLLM.
- `in_server/`: code that runs inside a vLLM server (the gloo weight-transfer engine).
- `producer.py`: the one interface a module asks for a generation (synchronous, episodes, asynchronous), owning
  the engine (`engine_owner.py`) and the reward scoring; `choice.py` which producer a run's settings choose;
  `host.py` what it uses of the module; `asynchronous.py`
  (the staleness schedule), `multi_turn.py` (episodes), `dynamic_sampling.py` (DAPO's refills, a producer around
  another): how a generation is produced; `weights.py` streams the policy's weights, a bucket at a time.
"""

from lit_rl.rollout.base import RolloutEngine, RolloutOutput, SamplingParams
from lit_rl.rollout.engine_config import EngineConfig, HFGenerate, VLLMColocate, VLLMServer, WeightTransfer
from lit_rl.rollout.engines.hf import HFGenerateEngine

__all__ = [
    "EngineConfig",
    "HFGenerate",
    "HFGenerateEngine",
    "RolloutEngine",
    "RolloutOutput",
    "SamplingParams",
    "VLLMColocate",
    "VLLMServer",
    "WeightTransfer",
]


def __getattr__(name: str) -> object:
    # 0.2's merged settings of both vLLM engines: each engine now reads its own config class, its options declared once.
    if name == "VLLMConfig":  # ImportError: `from lit_rl.rollout import VLLMConfig` shows it (AttributeError would not)
        raise ImportError(
            "lit_rl.rollout.VLLMConfig is gone: the vLLM engines read their configs, VLLMColocate and VLLMServer "
            "(model.rollout.engine; the server's weight transport is VLLMServer(transfer=WeightTransfer(...)))"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
