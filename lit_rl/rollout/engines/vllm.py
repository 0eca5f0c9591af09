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

Independent episodes (`lit_rl.rollout.multi_turn`) send each turn from a thread of its own
(`concurrent_generate`): the turns go into vLLM's own scheduler as they arrive, and one engine step advances every
request running, whoever's, so a turn that arrives while others decode joins the next step (continuous batching, as a
vLLM server does with concurrent requests). With an engine per rank (`tensor_parallel_size` 1), each rank steps its
own apart from the others. vLLM's engine is not thread-safe: one thread of the engine's makes those steps
(`_EngineLoop`).

Log-probs are vLLM's `processed_logprobs`: of the distribution it sampled from (after temperature, and after
top-k/top-p truncation when those are on), which with `top_k=0, top_p=1` is exactly `softmax(logits / T)`, what
the trainer recomputes. With `min_new_tokens`, the first tokens' log-probs are of the distribution with the stop ids
masked (vLLM's min-tokens processor runs before them): they differ from the trainer's by the stop ids' small mass,
which the rollout log-prob metrics show and the importance correction handles.
"""

from __future__ import annotations

import logging
import os
import threading
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, ContextManager, Iterable, Iterator, Optional, Sequence

import torch

from lit_rl.errors import ConfigError
from lit_rl.rollout.base import RolloutOutput, SamplingParams, draw_seeds, padded_output, unpadded_prompts
from lit_rl.rollout.engine_config import VLLMColocate
from lit_rl.rollout.engines.placement import EXECUTOR, EnginePlacement, tp_slice
from lit_rl.rollout.engines.vllm_config import VLLM_DTYPES

log = logging.getLogger(__name__)

TORCH_TO_VLLM_DTYPE = {dtype: name for name, dtype in reversed(VLLM_DTYPES.items())}  # float32, not float
SLEEP_LEVEL = 2  # release weights and KV cache; the next push refills the weights

PhaseTimer = Callable[[str], ContextManager[None]]


def vllm_sampling_params(params: SamplingParams, seed: int, eos_token_ids: Sequence[int]):
    """lit-rl's sampling settings as vLLM's, for one completion with its own seed."""
    import vllm
    from vllm.sampling_params import RequestOutputKind

    return vllm.SamplingParams(
        n=1,
        output_kind=RequestOutputKind.FINAL_ONLY,  # a finished request's output alone (what `LLM.generate` asks)
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
    config: VLLMColocate,
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
        config: VLLMColocate,
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
        self.steps = _EngineLoop(llm, self._own_precision)
        # Each rank's engine of one member steps apart from the others' (its TP group is itself).
        self.concurrent_on_every_rank = self.placement.tensor_parallel_size == 1

    @classmethod
    def start(
        cls,
        config: VLLMColocate,
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
        prompts, seeds, mine = self._gather_tp_group(*_seeded_prompts(prompt_ids, prompt_mask, seeds))
        requests = [{"prompt_token_ids": ids} for ids in prompts]  # vLLM's `TokensPrompt` (a TypedDict)
        sampling = [vllm_sampling_params(params, seed, self.eos_token_ids) for seed in seeds]
        with self.steps.alone():
            self._wake_cache()
            with self._own_precision():
                outputs = self.llm.generate(requests, sampling, use_tqdm=False)[mine]
        return self._padded(outputs, prompt_ids.device)

    def concurrent_generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        params: SamplingParams,
        seeds: Optional[Sequence[int]] = None,
    ) -> RolloutOutput:
        """`generate` for an independent episode's turn, from any thread: its requests join vLLM's scheduler at
        the engine's next step, beside every other thread's, and this thread waits until they have finished
        (`_EngineLoop`). One engine of one rank only: a tensor-parallel group samples together."""
        if self.tp_group is not None:
            raise RuntimeError("a tensor-parallel colocated engine samples its group's turns together (`generate`)")
        if not self._cache_awake:  # after a sleep, the first turn of a rank whose first turns are its own
            with self.steps.between_steps(), self._own_precision():  # on this rank's GPU, not the thread's first
                self._wake_cache()
        prompts, seeds = _seeded_prompts(prompt_ids, prompt_mask, seeds)
        requests = [{"type": "token", "prompt_token_ids": ids} for ids in prompts]  # vLLM's `TokensInput`
        sampling = [vllm_sampling_params(params, seed, self.eos_token_ids) for seed in seeds]
        outputs = self.steps.sample(requests, sampling)
        return self._padded(outputs, prompt_ids.device)

    def _padded(self, outputs: list[Any], device: torch.device) -> RolloutOutput:
        """vLLM's finished requests (one completion each) as a `RolloutOutput` on `device`."""
        token_ids = [list(out.outputs[0].token_ids) for out in outputs]
        logprobs = [
            [step[token].logprob for step, token in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]
            for out in outputs
        ]
        return padded_output(token_ids, logprobs, self.eos_token_ids, self.pad_token_id, device)

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
        with self.steps.alone():
            if not self._weights_awake:
                with self.phase("engine_wake"):
                    self.llm.wake_up(tags=["weights"])
                self._weights_awake = True
            with self._own_precision():
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named_tensors)})
            if self.llm.reset_prefix_cache() is False:  # blocks still held: the old weights' cache would be reused
                raise RuntimeError(
                    "vLLM refused to reset its prefix cache after a weight push: KV blocks are still held"
                )
            self.holds_weights = True

    def sleep(self) -> None:
        """With sleep mode, release the engine's GPU memory (weights and KV cache) until the next push: the trainer
        calls it when a rollout's generations are done (a training generation, or the end of validation), so the
        batches of one validation share one push. A no-op without sleep mode, or when asleep already."""
        if not self.config.enable_sleep_mode or not (self._weights_awake or self._cache_awake):
            return
        with self.steps.alone(), self.phase("engine_sleep"):
            self.llm.sleep(level=SLEEP_LEVEL)
        self._weights_awake = self._cache_awake = self.holds_weights = False

    @contextmanager
    def _own_precision(self) -> Iterator[None]:
        """The trainer's autocast off (vLLM computes in its own dtype), on this rank's GPU: an independent episode's
        thread starts on the process's first."""
        on_device = torch.cuda.device(self.placement.local_rank) if self.device_type == "cuda" else nullcontext()
        with on_device, torch.autocast(self.device_type, enabled=False):
            yield

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
        self.steps.close()  # a turn still being sampled (its episode abandoned) ends with an error, not in vLLM
        llm, self.llm = self.llm, None
        if llm is not None:
            shutdown = getattr(getattr(llm, "llm_engine", None), "shutdown", None)
            if callable(shutdown):
                shutdown()
            del llm


class _Turn:
    """One `concurrent_generate` call's requests, and vLLM's outputs of them as they finish."""

    def __init__(self, ids: list[str]) -> None:
        self.ids = ids
        self.outputs: dict[str, Any] = {}
        self.error: Optional[BaseException] = None
        self.done = threading.Event()

    def fail(self, error: BaseException) -> None:
        if not self.done.is_set():
            self.error = error
            self.done.set()


class _EngineLoop:
    """vLLM's engine fed from many threads (`VLLMColocateEngine.concurrent_generate`) and stepped by one of its own.

    A caller queues its requests and waits for them. The loop's thread, while any request is queued or running,
    adds every request queued since its last step to vLLM's scheduler and runs one step, which advances every
    request running, whoever's; a caller is woken when its own requests have finished. So a request joins the batch
    running at the next step, never waiting for another's to finish. One thread makes every call into vLLM (its
    engine is not thread-safe) and does the CPU kernels' work on one thread pool, however many episodes wait.

    A request vLLM refuses (`add_request` raises: a transcript past `max_model_len`) fails its own caller. A step
    that raises fails every caller waiting, and every later one: the engine is broken.

    Every other call into vLLM (`LLM.generate`, a push, sleep) is made `alone()`, between two steps, after aborting
    every request still queued or running: their callers were abandoned (an episode stopped by Ctrl-C or a failure),
    and `LLM.generate` would otherwise collect their outputs as its own."""

    def __init__(self, llm: Any, precision: Callable[[], ContextManager[None]]) -> None:
        self.llm = llm
        self.precision = precision  # around each step: the trainer's autocast off, on this rank's GPU
        self.state = threading.Condition()  # guards everything below
        self.stepping = False  # a call into vLLM is under way
        self.alone_waiting = 0  # `alone()` calls and `close` waiting: they go before the next step
        self.queued: list[tuple[_Turn, str, dict, Any]] = []  # (its turn, request id, prompt, sampling params)
        self.in_vllm: dict[str, _Turn] = {}  # the requests vLLM is running, by id
        self.failure: Optional[BaseException] = None
        self.closed = False
        self.thread: Optional[threading.Thread] = None
        # The CPU kernels' thread count of the thread that built the engine, which vLLM's CPU attention checks
        # against its own (a new thread starts with OpenMP's default: every core).
        self.num_threads = torch.get_num_threads()

    def sample(self, requests: list[dict], sampling: list[Any]) -> list:
        """vLLM's finished outputs of `requests` (one `SamplingParams` each), in their order."""
        with self.state:
            if self.closed or self.failure is not None:
                raise RuntimeError("the colocated vLLM engine is closed or failed") from self.failure
            turn = _Turn([str(next(self.llm.request_counter)) for _ in requests])  # `LLM.generate`'s ids
            self.queued.extend((turn, *request) for request in zip(turn.ids, requests, sampling))
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="lit-rl-vllm-steps", daemon=True)
                self.thread.start()
            self.state.notify_all()
        turn.done.wait()
        if turn.error is not None:
            raise turn.error
        return [turn.outputs[i] for i in turn.ids]

    def _run(self) -> None:
        torch._C.set_num_threads(self.num_threads)  # `torch.set_num_threads` itself vLLM's CPU worker disables
        while True:
            with self.state:
                self.state.wait_for(lambda: self.closed or (self._has_work() and not self._someone_else_first()))
                if self.closed:
                    return
                self.stepping = True
                queued, self.queued = self.queued, []
            outputs: list[Any] = []
            try:
                with self.precision():
                    outputs = self._step(queued)
            except BaseException as err:  # vLLM failed: no turn waiting or to come can be sampled
                self._broken(err)
                return
            self._step_done(outputs)

    def _broken(self, err: BaseException) -> None:
        """(On the loop's thread, after a step raised.) Every turn waiting fails, every later one at once; the
        requests vLLM still holds are aborted, if it still answers, so that no later `LLM.generate` takes them."""
        log.error("the colocated vLLM engine's step failed", exc_info=err)
        with self.state:
            self.failure = err
            running = self._fail_all(RuntimeError(f"the colocated vLLM engine failed: {type(err).__name__}: {err}"))
        try:
            if running:
                self.llm.llm_engine.abort_request(running)
        except Exception:  # it does not: the run is stopping on the failure anyway
            log.exception("aborting the failed step's requests failed too")
        finally:
            self._step_done([])

    def _step(self, queued: list[tuple[_Turn, str, dict, Any]]) -> list[Any]:
        """(On the loop's thread.) Add `queued` to vLLM and run one step; vLLM's outputs."""
        engine = self.llm.llm_engine
        for turn, request_id, prompt, params in queued:
            if turn.done.is_set():  # another request of its turn was refused
                continue
            try:
                engine.add_request(request_id, prompt, params)
            except Exception as err:  # this request's own failure: its caller raises it
                with self.state:
                    running = [i for i in turn.ids if self.in_vllm.pop(i, None) is not None]
                if running:
                    engine.abort_request(running)
                turn.fail(err)
                continue
            with self.state:
                self.in_vllm[request_id] = turn
        if engine.has_unfinished_requests():
            return engine.step()
        with self.state:  # vLLM holds none of them any more: their callers must not wait on
            lost = RuntimeError("vLLM dropped requests of the colocated engine unfinished")
            for turn in self.in_vllm.values():
                turn.fail(lost)
            self.in_vllm = {}
        return []

    def _step_done(self, outputs: list[Any]) -> None:
        with self.state:
            for output in outputs:
                turn = self.in_vllm.pop(output.request_id, None) if output.finished else None
                if turn is not None:
                    turn.outputs[output.request_id] = output
                    if len(turn.outputs) == len(turn.ids):
                        turn.done.set()
            self.stepping = False
            self.state.notify_all()

    @contextmanager
    def alone(self) -> Iterator[None]:
        """Between two steps, with every request still queued or running aborted: no one waits for them."""
        with self.between_steps():
            with self.state:
                if self.queued or self.in_vllm:
                    log.warning("aborting %d abandoned vLLM requests", len(self.queued) + len(self.in_vllm))
                abandoned = RuntimeError("the colocated vLLM engine stopped this turn's requests (abandoned)")
                running = self._fail_all(abandoned)
            if running:
                self.llm.llm_engine.abort_request(running)
            yield

    @contextmanager
    def between_steps(self) -> Iterator[None]:
        """After the step under way, if any, and before the next."""
        with self.state:
            self._wait_for_the_step_under_way()
            self.stepping = True
        try:
            yield
        finally:
            self._step_done([])

    def close(self) -> None:
        """No step from now on (after the one under way, if any): vLLM is about to shut down."""
        with self.state:
            self._wait_for_the_step_under_way()
            self.closed = True
            self._fail_all(RuntimeError("the colocated vLLM engine stopped this turn's requests (closed)"))
            self.llm = None  # the engine's memory goes with the last reference to it
            self.state.notify_all()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join()

    def _has_work(self) -> bool:
        return bool(self.queued or self.in_vllm)

    def _someone_else_first(self) -> bool:
        return self.stepping or self.alone_waiting > 0

    def _fail_all(self, error: BaseException) -> list[str]:
        """(Holding `state`.) Every turn queued or running fails with `error`. vLLM is told nothing here: the ids
        it holds are returned, for the caller to abort outside the lock."""
        for turn in [*self.in_vllm.values(), *(queued[0] for queued in self.queued)]:
            turn.fail(error)
        running = sorted(self.in_vllm)
        self.queued, self.in_vllm = [], {}
        return running

    def _wait_for_the_step_under_way(self) -> None:
        """(Holding `state`.) Until no step runs; no step starts meanwhile."""
        self.alone_waiting += 1
        try:
            self.state.wait_for(lambda: not self.stepping)
        finally:
            self.alone_waiting -= 1
            self.state.notify_all()  # if this wait was interrupted, the loop may step again


def _seeded_prompts(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, seeds: Optional[Sequence[int]]
) -> tuple[list[list[int]], list[int]]:
    """Each row's prompt ids and its seed (drawn from the global torch RNG when none are given)."""
    prompts = unpadded_prompts(prompt_ids, prompt_mask)
    return prompts, list(draw_seeds(len(prompts)) if seeds is None else seeds)


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
    from lit_rl.rollout.server.client import free_port

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
