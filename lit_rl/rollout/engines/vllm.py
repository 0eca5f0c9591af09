"""Colocated rollouts: an in-process `vllm.LLM` next to the policy. The only module that imports vLLM.

Placement (`lit_rl.rollout.engines.placement`): each trainer rank builds its engine with vLLM's `external_launcher`
executor, so the engine's worker runs in the trainer's process, on the rank's own device (`cuda:LOCAL_RANK`), inside
the trainer's process group. With `tensor_parallel_size = t`, each block of t consecutive ranks runs one engine:
its members gather their prompts, all generate the whole set (vLLM's TP workers must see the same requests), and
each keeps its own rows.

The engine starts from the model's config with dummy weights (`load_format="dummy"`): the trainer pushes the
policy's weights before the first generation, and after every optimizer step that changed them, through
`collective_rpc("reload_weights")` in the same process (no copy through a file or socket). The weights may
arrive as a lazy iterator (`lit_rl.rollout.weights.policy_weight_stream`), which gathers sharded parameters
bucket by bucket while vLLM consumes them. The prefix cache is reset after each push, since cached prompt states
belong to the old weights.

Sleep mode (GPU): between rollouts the engine holds no GPU memory (`sleep(level=2)`: weights and KV cache
released), so the policy's update has it. The order is: wake the weights, push, wake the KV cache, generate, sleep
(`sleep()`, which the trainer calls once a rollout's generations are done). Level 2 drops the weights rather than
offloading them to CPU memory (level 1 would hold a copy of every rank's engine weights in host memory), so a push
must come after every sleep: `holds_weights` says so.

Log-probs are vLLM's `processed_logprobs`: of the distribution it sampled from (after temperature, and after
top-k/top-p truncation when those are on), which with `top_k=0, top_p=1` is exactly `softmax(logits / T)`, what
the trainer recomputes. With `min_new_tokens`, the first tokens' log-probs are of the distribution with the stop ids
masked (vLLM's min-tokens processor runs before them): they differ from the trainer's by the stop ids' small mass,
which the rollout log-prob metrics show and the importance correction handles.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, ContextManager, Iterable, Iterator, Optional, Sequence

import torch

from lit_rl.errors import ConfigError
from lit_rl.rollout.base import RolloutOutput, SamplingParams, draw_seeds, padded_output, unpadded_prompts
from lit_rl.rollout.engines.placement import EXECUTOR, EnginePlacement, tp_slice
from lit_rl.rollout.engines.vllm_config import VLLM_DTYPES, VLLMConfig

log = logging.getLogger(__name__)

TORCH_TO_VLLM_DTYPE = {dtype: name for name, dtype in reversed(VLLM_DTYPES.items())}  # float32, not float
SLEEP_LEVEL = 2  # release weights and KV cache; the next push refills the weights

PhaseTimer = Callable[[str], ContextManager[None]]


def vllm_sampling_params(params: SamplingParams, seed: int, eos_token_ids: Sequence[int]):
    """lit-rl's sampling settings as vLLM's, for one completion with its own seed."""
    import vllm

    return vllm.SamplingParams(
        n=1,
        max_tokens=params.max_new_tokens,
        min_tokens=params.min_new_tokens,
        temperature=0.0 if params.greedy else params.temperature,
        top_p=1.0 if params.greedy else params.top_p,
        top_k=0 if params.greedy else params.top_k,
        seed=seed,
        logprobs=0,  # the sampled token's log-prob only
        stop_token_ids=list(eos_token_ids),
        detokenize=False,  # the trainer decodes with its own tokenizer
    )


def engine_kwargs(
    config: VLLMConfig,
    model_path: str,
    dtype: str,
    placement: EnginePlacement,
    on_gpu: bool,
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """The `vllm.LLM(...)` arguments of rank `placement.rank`'s colocated engine (`dtype`: vLLM's name)."""
    return dict(
        model=model_path,
        load_format="dummy",  # the trainer pushes the real weights before the first generation
        skip_tokenizer_init=True,  # prompts arrive as token ids; completions are decoded by the trainer
        generation_config="vllm",  # ignore the repository's sampling defaults: sample what we ask for
        logprobs_mode="processed_logprobs",
        dtype=dtype,
        seed=placement.engine_seed,
        distributed_executor_backend=EXECUTOR,  # the worker in this process, on cuda:LOCAL_RANK
        tensor_parallel_size=placement.tensor_parallel_size,
        max_model_len=config.max_model_len,
        gpu_memory_utilization=config.gpu_memory_utilization,
        enable_prefix_caching=config.enable_prefix_caching,
        enable_sleep_mode=config.enable_sleep_mode,
        enforce_eager=(not on_gpu) if config.enforce_eager is None else config.enforce_eager,
        trust_remote_code=trust_remote_code,
    )


class VLLMColocateEngine:
    """An in-process vLLM engine on this rank's device. Not an `nn.Module`; the trainer holds it outside the model.

    Build it with `VLLMColocateEngine.start(...)`; the constructor takes an already built `llm` (tests pass a
    recording fake).

    Args:
        llm: the `vllm.LLM` (or an object with its `generate`, `collective_rpc`, `reset_prefix_cache`, `sleep`,
            `wake_up` methods).
        config: the engine's settings (`lit_rl.rollout.engine_config.VLLMColocate`).
        eos_token_ids: ids that end a completion.
        pad_token_id: id right-padding the returned completions.
        placement: this rank's place (its TP group); None: a single engine of one rank.
        tp_group: the `torch.distributed` group of this rank's TP group (None when it has one member).
        phase: `phase(name)` times a part of the work (`perf/engine_wake_s`, `perf/engine_sleep_s`).
        device_type: `cuda` or `cpu`: vLLM runs with that device's autocast off (a training step runs inside the
            trainer's autocast under mixed precision; vLLM computes in its own dtype).
    """

    needs_weights = True

    def __init__(
        self,
        llm: Any,
        config: VLLMConfig,
        eos_token_ids: Sequence[int],
        pad_token_id: int,
        placement: Optional[EnginePlacement] = None,
        tp_group: Optional[Any] = None,
        phase: Optional[PhaseTimer] = None,
        device_type: str = "cpu",
    ) -> None:
        self.llm = llm
        self.device_type = device_type
        self.config = config
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.placement = placement or EnginePlacement(0, 0, 1, 1)
        self.tp_group = tp_group
        self.phase: PhaseTimer = phase or (lambda name: nullcontext())
        self._weights_awake = self._cache_awake = True
        self.holds_weights = True  # dummy weights until the first push, but allocated: a push may load them

    @classmethod
    def start(
        cls,
        config: VLLMConfig,
        model_name_or_path: str,
        dtype: torch.dtype,
        device: torch.device,
        eos_token_ids: Sequence[int],
        pad_token_id: int,
        placement: EnginePlacement,
        trust_remote_code: bool = False,
        phase: Optional[PhaseTimer] = None,
    ) -> "VLLMColocateEngine":
        """Build rank `placement.rank`'s engine. A collective: every rank calls it at the same time (vLLM
        all-reduces the free memory over the world, and the TP groups are created by all ranks).

        `dtype`: the engine's dtype when `config.dtype` is `auto` (the trainer's compute dtype)."""
        on_gpu = device.type == "cuda"
        if config.enable_sleep_mode and not on_gpu:
            raise ConfigError("model.rollout.engine.enable_sleep_mode needs a CUDA device (it frees GPU memory)")
        tp_group = _tp_subgroup(placement)
        # The engine core must run in this process: `reload_weights` then receives the tensors themselves.
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
            log.warning("VLLM_ENABLE_V1_MULTIPROCESSING is set; the colocated engine sets it to 0 (in-process)")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if not on_gpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(config.cpu_kvcache_space_gib))
        os.environ.update(placement.environment(*_master_address()))
        import vllm

        vllm_dtype = TORCH_TO_VLLM_DTYPE.get(dtype, "auto") if config.dtype == "auto" else config.dtype
        kwargs = engine_kwargs(
            config, model_name_or_path, vllm_dtype, placement, on_gpu, trust_remote_code=trust_remote_code
        )
        # vLLM seeds the global RNGs when it starts; keep the trainer's streams where they were. Training samples
        # do not read them (each completion has a seed of its place in the global batch), but sampled validation
        # and anything else the trainer draws (dropout, shuffling) would then depend on when the engine started,
        # which differs between a resumed run and one that never stopped.
        with _rng_states_kept(device), torch.autocast(device.type, enabled=False):
            llm = vllm.LLM(**kwargs)
        # vLLM's CPU platform rewrites LOCAL_WORLD_SIZE to the TP size; put the trainer's value back.
        os.environ["LOCAL_WORLD_SIZE"] = str(placement.local_world_size)
        engine = cls(llm, config, eos_token_ids, pad_token_id, placement, tp_group, phase, device.type)
        log.info("rank %d: colocated vLLM engine %s", placement.rank, engine.describe())
        return engine

    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        params: SamplingParams,
        seeds: Optional[Sequence[int]] = None,
    ) -> RolloutOutput:
        prompts = unpadded_prompts(prompt_ids, prompt_mask)
        seeds = list(draw_seeds(len(prompts)) if seeds is None else seeds)
        prompts, seeds, mine = self._gather_tp_group(prompts, seeds)
        requests = [{"prompt_token_ids": ids} for ids in prompts]  # vLLM's `TokensPrompt` (a TypedDict)
        sampling = [vllm_sampling_params(params, seed, self.eos_token_ids) for seed in seeds]
        self._wake_cache()
        with self._own_precision():
            outputs = self.llm.generate(requests, sampling, use_tqdm=False)[mine]
        token_ids = [list(out.outputs[0].token_ids) for out in outputs]
        logprobs = [
            [step[token].logprob for step, token in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]
            for out in outputs
        ]
        return padded_output(token_ids, logprobs, self.eos_token_ids, self.pad_token_id, prompt_ids.device)

    def _gather_tp_group(self, prompts: list[list[int]], seeds: list[int]) -> tuple[list, list, slice]:
        """Every request of this rank's TP group (in rank order) and the slice of them that is this rank's."""
        if self.tp_group is None:
            return prompts, seeds, slice(0, len(prompts))
        members: list[Any] = [None] * self.placement.tensor_parallel_size
        torch.distributed.all_gather_object(members, (prompts, seeds), group=self.tp_group)
        sizes = [len(member_prompts) for member_prompts, _ in members]
        return (
            [ids for member_prompts, _ in members for ids in member_prompts],
            [seed for _, member_seeds in members for seed in member_seeds],
            tp_slice(sizes, self.placement.tp_rank),
        )

    def update_weights(self, named_tensors: Optional[Iterable[tuple[str, torch.Tensor]]] = None) -> None:
        """Load the policy's current weights in place and drop the prefix cache computed with the old ones.

        `named_tensors` may be a lazy iterator; it is consumed once, as vLLM loads (the caller's gathering of
        sharded parameters happens inside it)."""
        if named_tensors is None:
            raise ValueError("VLLMColocateEngine.update_weights needs the policy's (name, tensor) pairs")
        if not self._weights_awake:
            with self.phase("engine_wake"):
                self.llm.wake_up(tags=["weights"])
            self._weights_awake = True
        with self._own_precision():
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named_tensors)})
        if self.llm.reset_prefix_cache() is False:  # blocks still held: the old weights' cache would be reused
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight push: KV blocks are still held")
        self.holds_weights = True

    def sleep(self) -> None:
        """With sleep mode, release the engine's GPU memory (weights and KV cache) until the next push: the trainer
        calls it when a rollout's generations are done (a training generation, or the end of validation), so the
        batches of one validation share one push. A no-op without sleep mode, or when asleep already."""
        if not self.config.enable_sleep_mode or not (self._weights_awake or self._cache_awake):
            return
        with self.phase("engine_sleep"):
            self.llm.sleep(level=SLEEP_LEVEL)
        self._weights_awake = self._cache_awake = self.holds_weights = False

    def _own_precision(self) -> ContextManager[None]:
        """The trainer's autocast off: vLLM computes in its own dtype."""
        return torch.autocast(self.device_type, enabled=False)

    def _wake_cache(self) -> None:
        if not self.holds_weights:
            raise RuntimeError("the colocated vLLM engine slept (its weights were released): push weights first")
        if not self._cache_awake:
            with self.phase("engine_wake"):
                self.llm.wake_up(tags=["kv_cache"])
            self._cache_awake = True

    def describe(self) -> dict[str, Any]:
        """What vLLM itself built (read from vLLM's state, not from our plan): the executor class, the worker's
        device, the model's dtype, and the global ranks of its tensor-parallel group and world."""
        from vllm.distributed.parallel_state import get_tp_group, get_world_group

        executor = self.llm.llm_engine.model_executor
        return {
            "executor": type(executor).__name__,
            "device": str(executor.driver_worker.worker.device),
            "dtype": str(self.llm.llm_engine.model_config.dtype).removeprefix("torch."),
            "tp_ranks": list(get_tp_group().ranks),
            "world_ranks": list(get_world_group().ranks),
        }

    def close(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:
            shutdown = getattr(getattr(llm, "llm_engine", None), "shutdown", None)
            if callable(shutdown):
                shutdown()
            del llm


def _tp_subgroup(placement: EnginePlacement) -> Optional[Any]:
    """This rank's TP group as a `torch.distributed` group (created by every rank together); None for t = 1."""
    if placement.tensor_parallel_size == 1:
        return None
    group, _ = torch.distributed.new_subgroups_by_enumeration(placement.all_tp_groups())
    return group


def _master_address() -> tuple[str, int]:
    """The rendezvous of the trainer's process group, or (single process, none yet) a free local port for the
    process group of one that vLLM creates."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "0"))
    from lit_rl.rollout.engines.vllm_server import free_port

    return "127.0.0.1", free_port()


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
