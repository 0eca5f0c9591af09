"""Colocated rollouts: an in-process `vllm.LLM` next to the policy. The only module that imports vLLM.

The engine starts from the model's config with dummy weights (`load_format="dummy"`): the trainer pushes the
policy's weights before the first generation, and after every optimizer step that changed them, through
`collective_rpc("reload_weights")` in the same process (no copy through a file or socket). The prefix cache is
reset after each push, since cached prompt states belong to the old weights.

Log-probs are vLLM's `processed_logprobs`: of the distribution it sampled from (after temperature, and after
top-k/top-p truncation when those are on), which with `top_k=0, top_p=1` is exactly `softmax(logits / T)`, what
the trainer recomputes.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from typing import Iterable, Iterator, Optional, Sequence

import torch

from lit_rl.errors import ConfigError
from lit_rl.rollout.base import RolloutOutput, SamplingParams, draw_seeds, padded_output, unpadded_prompts
from lit_rl.rollout.config import VLLMConfig

log = logging.getLogger(__name__)

_TORCH_TO_VLLM_DTYPE = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def vllm_sampling_params(params: SamplingParams, seed: int, eos_token_ids: Sequence[int]):
    """lit-rl's sampling settings as vLLM's, for one completion with its own seed."""
    import vllm

    return vllm.SamplingParams(
        n=1,
        max_tokens=params.max_new_tokens,
        temperature=0.0 if params.greedy else params.temperature,
        top_p=1.0 if params.greedy else params.top_p,
        top_k=0 if params.greedy else params.top_k,
        seed=seed,
        logprobs=0,  # the sampled token's log-prob only
        stop_token_ids=list(eos_token_ids),
        detokenize=False,  # the trainer decodes with its own tokenizer
    )


class VLLMColocateEngine:
    """An in-process vLLM engine on this rank's device. Not an `nn.Module`; the trainer holds it outside the model.

    Args:
        config: `model.vllm`.
        model_name_or_path: directory or hub id of the policy's config (its weights are never read here).
        policy_dtype: the policy's dtype (`config.dtype == "auto"` follows it).
        device: the trainer's device for this rank.
        eos_token_ids: ids that end a completion.
        pad_token_id: id right-padding the returned completions.
        seed: the engine's base seed (every completion also gets its own, from the torch RNG).
        trust_remote_code: passed to vLLM (off by default).
    """

    needs_weights = True

    def __init__(
        self,
        config: VLLMConfig,
        model_name_or_path: str,
        policy_dtype: torch.dtype,
        device: torch.device,
        eos_token_ids: Sequence[int],
        pad_token_id: int,
        seed: int = 0,
        trust_remote_code: bool = False,
    ) -> None:
        on_gpu = device.type == "cuda"
        if config.enable_sleep_mode and not on_gpu:
            raise ConfigError("model.vllm.enable_sleep_mode needs a CUDA device (it frees GPU memory)")
        # The engine core must run in this process: `reload_weights` then receives the tensors themselves.
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
            log.warning("VLLM_ENABLE_V1_MULTIPROCESSING is set; the colocated engine sets it to 0 (in-process)")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if not on_gpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(config.cpu_kvcache_space_gib))
        import vllm

        dtype = _TORCH_TO_VLLM_DTYPE.get(policy_dtype, "auto") if config.dtype == "auto" else config.dtype
        self.config = config
        self.device = device
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = pad_token_id
        self._asleep = False
        # vLLM seeds the global RNGs when it starts; keep the trainer's streams where they were, or a run that
        # resumes (and starts its engine later) would sample differently from one that never stopped.
        with _rng_states_kept(device):
            self.llm = vllm.LLM(
                model=model_name_or_path,
                load_format="dummy",  # the trainer pushes the real weights before the first generation
                skip_tokenizer_init=True,  # prompts arrive as token ids; completions are decoded by the trainer
                generation_config="vllm",  # ignore the repository's sampling defaults: sample what we ask for
                logprobs_mode="processed_logprobs",
                dtype=dtype,
                seed=seed,
                max_model_len=config.max_model_len,
                gpu_memory_utilization=config.gpu_memory_utilization,
                tensor_parallel_size=config.tensor_parallel_size,
                enable_prefix_caching=config.enable_prefix_caching,
                enable_sleep_mode=config.enable_sleep_mode,
                enforce_eager=(not on_gpu) if config.enforce_eager is None else config.enforce_eager,
                trust_remote_code=trust_remote_code,
            )

    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        params: SamplingParams,
        seeds: Optional[Sequence[int]] = None,
    ) -> RolloutOutput:
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in unpadded_prompts(prompt_ids, prompt_mask)]
        seeds = draw_seeds(len(prompts)) if seeds is None else seeds
        sampling = [vllm_sampling_params(params, seed, self.eos_token_ids) for seed in seeds]
        self._wake()
        outputs = self.llm.generate(prompts, sampling, use_tqdm=False)
        if self.config.enable_sleep_mode:
            self.llm.sleep(level=1)  # weights to CPU, KV cache dropped, until the next push or generation
            self._asleep = True
        token_ids = [list(out.outputs[0].token_ids) for out in outputs]
        logprobs = [
            [step[token].logprob for step, token in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]
            for out in outputs
        ]
        return padded_output(token_ids, logprobs, self.eos_token_ids, self.pad_token_id, prompt_ids.device)

    def update_weights(self, named_tensors: Optional[Iterable[tuple[str, torch.Tensor]]] = None) -> None:
        """Load the policy's current weights in place and drop the prefix cache computed with the old ones."""
        if named_tensors is None:
            raise ValueError("VLLMColocateEngine.update_weights needs the policy's (name, tensor) pairs")
        self._wake()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(named_tensors)})
        self.llm.reset_prefix_cache()

    def _wake(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def close(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:
            shutdown = getattr(llm.llm_engine, "shutdown", None)
            if callable(shutdown):
                shutdown()
            del llm


@contextmanager
def _rng_states_kept(device: torch.device) -> Iterator[None]:
    """Restore the torch (CPU and this GPU), Python and NumPy RNG states on exit."""
    import random

    import numpy as np

    python_state, numpy_state = random.getstate(), np.random.get_state()
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        yield
    random.setstate(python_state)
    np.random.set_state(numpy_state)
