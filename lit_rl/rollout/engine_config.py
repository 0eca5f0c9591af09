"""`model.rollout.engine`: which engine samples the completions, as a choice of typed configs.

Each config class is bound to one engine class and builds it (`build`):

    --model.rollout.engine HFGenerate                        # the default: `generate` on the policy itself
    --model.rollout.engine VLLMColocate                      # configs/rollout/vllm_colocate.yaml
    --model.rollout.engine VLLMServer                        # configs/rollout/vllm_server.yaml
    --model.rollout.engine my_package.engines.MyEngine       # any subclass of EngineConfig, by import path

and an engine's options follow it: `--model.rollout.engine.gpu_memory_utilization 0.5`, and for the server's weight
transport `--model.rollout.engine.transfer.method gloo`. A new engine is a config class (a subclass of
`EngineConfig` whose `__init__` takes its options) and the engine it builds (`lit_rl.rollout.base.RolloutEngine`);
no algorithm changes. An engine takes its config object itself (the vLLM engines read `VLLMColocate` and `VLLMServer`),
so each option is declared once, in its config class's signature.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, Iterator, Optional, get_args

import torch

from lit_rl.errors import ConfigError
from lit_rl.rollout.base import RolloutEngine
from lit_rl.rollout.engines.vllm_config import (
    COLLECTIVE_TRANSFERS,
    VLLM_DTYPES,
    LoraWeights,
    OnServerFailure,
    TransferMethod,
    check_colocate,
    check_server,
)
from lit_rl.rollout.host import RolloutHost

ENGINE_KEY = "model.rollout.engine"
PUSH_BUCKET_MIB = 512.0  # the default bucket of a weight push (`push_bucket_mib`), one value for every engine


class EngineConfig:
    """A rollout engine's settings; `build(module)` makes the engine. Subclass it for a new engine: its `__init__`
    takes the options (each stored as an attribute of the same name, so the run's config and checkpoint record
    them), and `build` returns a `RolloutEngine`.

    Class attributes a subclass may set (or take as options of the same name):
        samples_in_background: it can sample while the trainer trains (`model.rollout.max_staleness > 0`).
        colocated: it runs in the trainer's process on the trainer's device (its placement is checked at setup).
        samples_on_trainer_devices: its generation runs on the trainer's devices (HF `generate`, colocated vLLM),
            so its model FLOPs count in the trainer's utilisation (`perf/mfu`).
        tensor_parallel_size: the trainer ranks one colocated engine spans.
        push_bucket_mib: the policy's weights reach an engine that holds its own a bucket of at most this many MiB
            at a time (`lit_rl.rollout.weights`).
        min_temperature: the lowest temperature above 0 it samples at as asked (vLLM raises a lower one to 0.01).
    """

    samples_in_background = False
    colocated = False
    samples_on_trainer_devices = False
    tensor_parallel_size: int = 1
    push_bucket_mib: float = PUSH_BUCKET_MIB
    min_temperature: float = 0.0

    def check(self) -> None:
        """Reject impossible settings at construction, naming the key (`model.rollout.engine.<option>`)."""

    def build(self, module: RolloutHost) -> RolloutEngine:
        """The engine, for the on-policy `module` that trains the policy (what it offers:
        `lit_rl.rollout.host.RolloutHost`). Called once, on every rank, at the first rollout."""
        raise NotImplementedError(f"{type(self).__name__} does not say how to build its engine (`build`)")

    def engine_dtype(self, compute_dtype: torch.dtype) -> Optional[torch.dtype]:
        """The dtype the engine computes in (None: not known here), for `model.rollout.correction: auto`."""
        return None

    def numerics_differ(self, compute_dtype: torch.dtype) -> bool:
        """Whether the engine's log-probs of a token can differ from the trainer's by more than float32
        rounding (then `model.rollout.correction: auto` corrects them): unless both compute in float32. An engine of
        unknown dtype differs; bf16 kernels of two libraries round differently even at the same dtype."""
        dtype = self.engine_dtype(compute_dtype)
        return dtype is None or dtype != torch.float32 or dtype != compute_dtype

    def options(self) -> dict[str, Any]:
        """The options this config was made with (its `__init__` arguments), as plain data."""
        names = [name for name in inspect.signature(type(self).__init__).parameters if name != "self"]
        # Set on the instance: a class default (`tensor_parallel_size`) is not an option the config was made with.
        return {name: _plain(vars(self)[name]) for name in names if name in vars(self)}

    def as_config(self) -> dict[str, Any]:
        """`{"class_path": ..., "init_args": ...}`: how LightningCLI writes a choice of class, and how checkpoints
        keep it."""
        return {"class_path": class_path(type(self)), "init_args": self.options()}

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.options() == self.options()

    def __hash__(self) -> int:
        return hash(type(self))

    def __repr__(self) -> str:
        args = ", ".join(f"{key}={value!r}" for key, value in self.options().items())
        return f"{type(self).__name__}({args})"


def class_path(cls: type) -> str:
    """The import path a config names an engine class by: `lit_rl.rollout.<Name>` for lit-rl's own."""
    if cls.__module__ == __name__:
        return f"lit_rl.rollout.{cls.__qualname__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def _plain(value: Any) -> Any:
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) and not isinstance(value, type) else value


LORA_WEIGHTS = get_args(LoraWeights)


class HFGenerate(EngineConfig):
    """Hugging Face `generate` on the policy being trained (the default): no extra package, nothing to push;
    finished rows leave the decoding batch (`lit_rl.rollout.engines.compact_decode`).

    Args:
        lora_weights: with a LoRA policy, what it samples from: `adapter` (the default: the adapter beside the
            frozen weights, as the trainer computes) or `merged` (the adapter merged into the weights in the weights'
            dtype, as an engine holding its own weights computes: vLLM). `merged` is a diagnostic, used by
            `lit-rl check --mismatch` to measure what merging alone does to the log-probs; not with sharded
            parameters (ZeRO-3, FSDP).
        compile: decode with a static KV cache and a `torch.compile`d one-token step
            (`lit_rl.rollout.engines.static_decode`; CUDA graphs on GPU). The same samples (float32: the same tokens,
            log-probs to float rounding); compiling costs seconds to tens of seconds at the first generation, repaid
            after about a hundred generations of a small model on CPU (`benchmarks/compiled_decoding.py`). Finished
            rows keep running. Not with ZeRO-3 or FSDP, nor with `lora_weights: merged`.
        gather_weights: under ZeRO-3, gather the policy's weights whole on each rank once per `generate` call and
            decode without DeepSpeed's per-module hooks, as TRL does by default (`ds3_gather_for_generation`): no
            decoding step gathers anything, for one whole copy of the policy per rank while it samples (0.27x the
            generation time on 2 CPU processes: `benchmarks/throughput.py`'s `hf_partitioned` rows). false: every
            decoding step gathers each layer again and the ranks step together, for a policy that does not fit
            whole on one device beside training's state (with true, its first generation ends the run in one line
            that says so). No effect under other strategies (FSDP decodes through its shards).
    """

    samples_on_trainer_devices = True

    def __init__(
        self, lora_weights: LoraWeights = "adapter", compile: bool = False, gather_weights: bool = True
    ) -> None:
        self.lora_weights = lora_weights
        self.compile = compile
        self.gather_weights = gather_weights
        self.check()

    def check(self) -> None:
        if self.lora_weights not in LORA_WEIGHTS:
            raise ConfigError(
                f"{ENGINE_KEY}.lora_weights must be one of {list(LORA_WEIGHTS)}, got {self.lora_weights!r}"
            )
        if self.compile and self.lora_weights == "merged":
            raise ConfigError(
                f"{ENGINE_KEY}.compile=true decodes through the adapter; {ENGINE_KEY}.lora_weights=merged is a "
                "diagnostic of the eager path: set one of them"
            )

    def build(self, module: RolloutHost) -> RolloutEngine:
        from lit_rl.modeling.models import model_eos_token_ids
        from lit_rl.rollout.engines.hf import HFGenerateEngine
        from lit_rl.training.strategies import is_zero3

        sharded = module.parameters_sharded()
        if self.lora_weights == "merged" and sharded:
            raise ConfigError(
                f"{ENGINE_KEY}.lora_weights=merged needs each rank to hold whole weights; this strategy shards them "
                "(ZeRO-3, FSDP): use DDP or ZeRO-2 to measure merging"
            )
        strategy = module.attached_strategy()
        if self.compile and (sharded or is_zero3(strategy)):
            raise ConfigError(
                f"{ENGINE_KEY}.compile=true needs each rank to hold the same whole weights from one generation to the "
                "next; this strategy shards them (ZeRO-3, FSDP), and ZeRO-3 gathers them anew for every generation: "
                "use DDP or ZeRO-2, or leave compile off"
            )
        eos_ids = model_eos_token_ids(module.policy, module.tokenizer.eos_token_id)
        whole_weights = None
        if self.gather_weights and is_zero3(strategy):  # then no forward of decoding is a collective
            whole_weights = partial(whole_weights_for_decoding, strategy, module.policy)
            sharded = False
        return HFGenerateEngine(
            module.policy,
            eos_ids,
            module.tokenizer.pad_token_id,
            synced_ranks=sharded,
            merged_lora=self.lora_weights == "merged",
            compiled=self.compile,
            whole_weights=whole_weights,
        )

    def numerics_differ(self, compute_dtype: torch.dtype) -> bool:
        # Otherwise it samples from the policy itself. Compiled kernels fuse and reorder: float32 rounding only, but
        # in bf16 their log-probs differ from the eager training forward's as another library's would.
        return self.lora_weights == "merged" or (self.compile and compute_dtype != torch.float32)


@contextmanager
def whole_weights_for_decoding(strategy: Any, policy: torch.nn.Module) -> Iterator[None]:
    """`zero3_whole_weights` for one `generate` call (`HFGenerate(gather_weights=True)` under ZeRO-3), with running
    out of memory, gathering the policy or decoding with it whole, reported as this option's one line."""
    from lit_rl.training.strategies import zero3_whole_weights

    gathered = False
    try:
        with zero3_whole_weights(strategy, policy):
            gathered = True
            yield
    except torch.OutOfMemoryError as err:  # when decoding: the whole copy is what its cache and activations lacked
        when = "decoding with it" if gathered else "gathering it"
        raise ConfigError(_whole_weights_out_of_memory(policy, when)) from err


def _whole_weights_out_of_memory(policy: torch.nn.Module, when: str) -> str:
    # A partitioned parameter holds a shard (or nothing): `ds_numel` is its whole size.
    whole_bytes = sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in policy.parameters())
    return (
        f"{ENGINE_KEY}.gather_weights: out of memory {when}: decoding under ZeRO-3 holds the whole policy "
        f"({whole_bytes / 2**30:.2f} GiB) on every rank; set --{ENGINE_KEY}.gather_weights false to decode through "
        "the partitions (slower), or make room (a smaller model.schedule.micro_batch_size or "
        "model.sampling.max_new_tokens, offloading)"
    )


# vLLM's `SamplingParams` raises a temperature in (0, 0.01) to 0.01, with a log line only.
VLLM_MIN_TEMPERATURE = 0.01


class VLLMColocate(EngineConfig):
    """An in-process `vllm.LLM` on each trainer rank's device, given the policy's weights in place before each
    generation that follows an optimizer step (`lit_rl.rollout.engines.vllm`).

    Args:
        gpu_memory_utilization: (GPU) share of the GPU vLLM may take for weights and KV cache.
        tensor_parallel_size: GPUs one engine spans: consecutive trainer ranks (a divisor of the ranks per node)
            serve one engine together and split its completions; 1: an engine per rank.
        max_model_len: context vLLM reserves KV cache for; None: the model's context.
        dtype: vLLM's dtype; `auto` follows the trainer's compute dtype (bf16 under `bf16-mixed`).
        enable_prefix_caching: reuse the KV cache of shared prompt prefixes (the G completions of a prompt share
            it). The cache is reset after every weight push.
        enable_sleep_mode: (GPU) release vLLM's GPU memory between rollouts (weights and KV cache, sleep level 2;
            the next push refills the weights) so the policy's update has it.
        enforce_eager: no CUDA graphs / compilation; None: True on CPU (compiling costs more than it saves there),
            False on GPU.
        cpu_kvcache_space_gib: (CPU) KV cache size in GiB (`VLLM_CPU_KVCACHE_SPACE`).
        push_bucket_mib: weights are gathered (ZeRO-3) and pushed a bucket of at most this many MiB at a time, so
            no rank holds a second full copy of the model (`lit_rl.rollout.weights`).
    """

    colocated = True
    min_temperature = VLLM_MIN_TEMPERATURE
    samples_on_trainer_devices = True

    def __init__(
        self,
        gpu_memory_utilization: float = 0.3,
        tensor_parallel_size: int = 1,
        max_model_len: Optional[int] = None,
        dtype: str = "auto",
        enable_prefix_caching: bool = True,
        enable_sleep_mode: bool = False,
        enforce_eager: Optional[bool] = None,
        cpu_kvcache_space_gib: int = 1,
        push_bucket_mib: float = PUSH_BUCKET_MIB,
    ) -> None:
        self.gpu_memory_utilization = gpu_memory_utilization
        self.tensor_parallel_size = tensor_parallel_size
        self.max_model_len = max_model_len
        self.dtype = dtype
        self.enable_prefix_caching = enable_prefix_caching
        self.enable_sleep_mode = enable_sleep_mode
        self.enforce_eager = enforce_eager
        self.cpu_kvcache_space_gib = cpu_kvcache_space_gib
        self.push_bucket_mib = push_bucket_mib

    def check(self) -> None:
        check_colocate(self)

    def build(self, module: RolloutHost) -> RolloutEngine:
        from lit_rl.modeling.models import model_eos_token_ids, resolve_model_path
        from lit_rl.rollout.engines.placement import EnginePlacement
        from lit_rl.rollout.engines.vllm import VLLMColocateEngine

        return VLLMColocateEngine.start(
            self,
            resolve_model_path(module.policy_args.model_name_or_path),
            dtype=module.compute_dtype(),
            device=module.device,
            eos_token_ids=model_eos_token_ids(module.policy, module.tokenizer.eos_token_id),
            pad_token_id=module.tokenizer.pad_token_id,
            placement=EnginePlacement.of(module.trainer, self.tensor_parallel_size),
            trust_remote_code=module.policy_args.trust_remote_code,
            phase=lambda name: module.timer.phase(name),  # the current timer (validation swaps it)
        )

    def engine_dtype(self, compute_dtype: torch.dtype) -> Optional[torch.dtype]:
        return compute_dtype if self.dtype == "auto" else VLLM_DTYPES.get(self.dtype, torch.float32)


@dataclass(frozen=True)
class WeightTransfer:
    """How the policy's weights reach vLLM servers (`--model.rollout.engine.transfer.method gloo`).

    Args:
        method: `file` (written into `sync_dir`, which the server must see: the same machine or a shared file
            system), `http` (uploaded to the weight receiver at `receiver_url`, which runs beside a server on another
            machine: `lit_rl.rollout.server.weight_receiver`), `gloo` or `nccl` (broadcast from rank 0 to the server's
            workers through vLLM's weight-transfer endpoints: no file, no disk;
            `lit_rl.rollout.server.collective_transfer`), or `auto` (default): `http` when `receiver_url` is set, else
            `file`. `gloo` works on CPU and GPU and needs lit-rl installed beside the server (it registers the engine
            with vLLM) and the server started with `--weight-transfer-config '{"backend": "lit_rl_gloo"}'`; `nccl` is
            vLLM's own engine (`--weight-transfer-config '{"backend": "nccl"}'`) and needs GPUs on both sides.
        sync_dir: directory, shared with the server, where rank 0 writes the policy's weights before asking the
            server to reload them; None: a fresh directory under /dev/shm (or the temp dir). With `http`, the local
            directory the files are written to before the upload.
        receiver_url: the weight receiver's URL (`python -m lit_rl.rollout.server.weight_receiver` on the server's
            machine), e.g. `http://10.0.0.2:8010`.
        receiver_urls: with `server_urls`: the receiver beside each server, in the same order. Servers on one
            machine may share one (it is uploaded to once per push); `receiver_url` alone serves them all.
        address: (`gloo`, `nccl`) this machine's address as the servers reach it: rank 0 hosts the rendezvous of
            each server's transfer group there, listening on that address alone (under `gloo` only until the
            workers have joined). 127.0.0.1 serves servers on this machine only.
        port: (`gloo`, `nccl`) the port of the first server's rendezvous, the next server's one above, and so on;
            0 (default): free ports.
    """

    method: TransferMethod = "auto"
    sync_dir: Optional[str] = None
    receiver_url: Optional[str] = None
    receiver_urls: Optional[list[str]] = None
    address: str = "127.0.0.1"
    port: int = 0


# lit-rl 0.1's flat `model.vllm` key for each `WeightTransfer` field.
_TRANSFER_FIELDS = {
    "method": "weight_transfer",
    "sync_dir": "weight_sync_dir",
    "receiver_url": "weights_url",
    "receiver_urls": "weights_urls",
    "address": "transfer_address",
    "port": "transfer_port",
}


class VLLMServer(EngineConfig):
    """Separately started vLLM OpenAI-compatible servers (`lit_rl.rollout.engines.vllm_server`): rank 0 sends the
    requests and pushes the weights (`transfer`). The only engine that samples in the background (`max_staleness > 0`).

    Args:
        server_url: base URL of the server. Bind it to 127.0.0.1 unless it must be reached from elsewhere.
        server_urls: several servers, data-parallel (instead of `server_url`): each generation's requests (one per
            prompt, its completions seeded from the request's seed) are dealt out across them, so which server
            samples a completion does not change it; every weight push goes to all of them.
        on_server_failure: what a server that stops answering does to the run: `fail` (default) stops it with one
            line naming the URL; `continue` warns in one line and deals that server's requests (and its share of
            later generations) to the others; the run stops only when none is left. Servers are health-checked
            before each generation; one out of service that answers again is taken back at the next weight push,
            with the weights.
        request_timeout_s: seconds one HTTP request may take before it counts as failed.
        max_retries: attempts after the first for a request that failed to connect, timed out, or got a 5xx
            answer; waits 1, 2, 4, ... seconds in between (uploads to a weight receiver: 0.5, 1, 2, ...). Then the
            run stops with an error naming the URL.
        wait_for_server_s: how long the first request waits for a server that is still starting.
        dtype: the dtype the server was started with, if known (`auto`: unknown), for `model.rollout.correction: auto`.
        push_bucket_mib: weights are gathered (ZeRO-3) and pushed a bucket of at most this many MiB at a time
            (one file per bucket with `transfer.method: file`).
        transfer: how the weights reach the servers (`WeightTransfer`).
        launch: start the server too: rank 0 starts one on 127.0.0.1 at a free port (`server_url` is not used),
            serving the policy's `model_name_or_path` with the flags lit-rl needs, waits until it answers, and stops it
            at the end of the run, on Ctrl-C and on failure, leaving no process behind. Its log is `vllm_server.log`
            in the run's log directory. On a machine without CUDA it runs in float32 with `--enforce-eager`.
        launch_args: further flags for the launched server, e.g. `["--max-model-len", "1024"]`, `["--dtype",
            "bfloat16"]` or, on a GPU the trainer shares, `["--gpu-memory-utilization", "0.3"]`. Flags lit-rl sets
            itself (`--model`, `--host`, `--port`, `--served-model-name`, `--logprobs-mode`, `--generation-config`,
            `--weight-transfer-config`; `--trust-remote-code` follows `model.policy.trust_remote_code`) are refused.
        launch_timeout_s: how long the launched server may take to answer before the run stops, in one line
            that quotes its log's last error line (as it does when the server exits).
    """

    samples_in_background = True
    min_temperature = VLLM_MIN_TEMPERATURE

    def __init__(
        self,
        server_url: str = "http://127.0.0.1:8000",
        server_urls: Optional[list[str]] = None,
        on_server_failure: OnServerFailure = "fail",
        request_timeout_s: float = 300.0,
        max_retries: int = 3,
        wait_for_server_s: float = 60.0,
        dtype: str = "auto",
        push_bucket_mib: float = PUSH_BUCKET_MIB,
        transfer: WeightTransfer = WeightTransfer(),
        launch: bool = False,
        launch_args: Optional[list[str]] = None,
        launch_timeout_s: float = 600.0,
    ) -> None:
        self.server_url = server_url
        self.server_urls = server_urls
        self.on_server_failure = on_server_failure
        self.request_timeout_s = request_timeout_s
        self.max_retries = max_retries
        self.wait_for_server_s = wait_for_server_s
        self.dtype = dtype
        self.push_bucket_mib = push_bucket_mib
        self.transfer = _as_transfer(transfer)
        self.launch = launch
        self.launch_args = launch_args
        self.launch_timeout_s = launch_timeout_s

    @property
    def uploads_weights(self) -> bool:
        """Whether the weights are uploaded to a receiver (`transfer.method`: http, or auto with a receiver)."""
        has_url = self.transfer.receiver_url is not None or self.transfer.receiver_urls is not None
        return self.transfer.method == "http" or (self.transfer.method == "auto" and has_url)

    @property
    def broadcasts_weights(self) -> bool:
        """Whether the weights are broadcast to the servers' workers (`transfer.method`: gloo, nccl)."""
        return self.transfer.method in COLLECTIVE_TRANSFERS

    def server_endpoints(self) -> list[tuple[str, Optional[str]]]:
        """(server URL, its weight receiver's URL or None) for every server, `server_urls` over `server_url`."""
        servers = [url.rstrip("/") for url in (self.server_urls or [self.server_url])]
        if not self.uploads_weights:
            return [(url, None) for url in servers]
        receivers = self.transfer.receiver_urls or [self.transfer.receiver_url] * len(servers)
        return list(zip(servers, [url.rstrip("/") for url in receivers]))  # one receiver, however it is spelled

    def check(self) -> None:
        check_server(self)
        if self.launch or self.launch_args:
            from lit_rl.rollout.server.launch import check_launch

            check_launch(self)

    def build(self, module: RolloutHost) -> RolloutEngine:
        from lit_rl.modeling.models import model_eos_token_ids
        from lit_rl.rollout.engines.vllm_server import VLLMServerEngine

        eos_ids = model_eos_token_ids(module.policy, module.tokenizer.eos_token_id)
        busy = module.engine_clock  # `perf/engine_idle_share`: the step's time with no request outstanding
        busy.counted = True
        if not self.launch:
            return VLLMServerEngine(self, eos_ids, module.tokenizer.pad_token_id, busy=busy)
        from lit_rl.modeling.models import resolve_model_path
        from lit_rl.rollout.server.launch import NOT_STARTED_URL, ServerLauncher

        launcher = ServerLauncher(
            model=resolve_model_path(module.policy_args.model_name_or_path),
            log_dir=module.trainer.log_dir,
            extra_args=list(self.launch_args or []),
            timeout_s=self.launch_timeout_s,
            weight_transfer=self.transfer.method,
            trust_remote_code=module.policy_args.trust_remote_code,
        )
        launched = copy.copy(self)  # the run's config keeps the URL it was given; the engine talks to the launched one
        launched.server_url = NOT_STARTED_URL  # its port is known once rank 0 started it (`VLLMServerEngine`)
        return VLLMServerEngine(launched, eos_ids, module.tokenizer.pad_token_id, launcher=launcher, busy=busy)

    def engine_dtype(self, compute_dtype: torch.dtype) -> Optional[torch.dtype]:
        dtype = self.dtype
        if self.launch:  # what the launched server is started with (`dtype` itself is refused with launch)
            from lit_rl.rollout.server.launch import launched_dtype

            dtype = launched_dtype(self.launch_args or [])
        return None if dtype == "auto" else VLLM_DTYPES.get(dtype, torch.float32)


def _as_transfer(value: Any) -> WeightTransfer:
    if isinstance(value, WeightTransfer):
        return value
    if isinstance(value, dict):
        unknown = sorted(set(value) - {f.name for f in dataclasses.fields(WeightTransfer)})
        if unknown:
            raise ConfigError(f"{ENGINE_KEY}.transfer.{unknown[0]}: unknown option")
        return WeightTransfer(**value)
    raise ConfigError(f"{ENGINE_KEY}.transfer must be a WeightTransfer or a mapping, got {type(value).__name__}")


BUILT_IN_ENGINES: dict[str, type[EngineConfig]] = {cls.__name__: cls for cls in (HFGenerate, VLLMColocate, VLLMServer)}


def engine_from_config(value: Any) -> EngineConfig:
    """`value` as an engine config: itself, None (HF `generate`), or `{"class_path", "init_args"}` as a checkpoint
    keeps it. From a checkpoint only lit-rl's own engines are built: a checkpoint imports no code (a run that used
    another engine names it again on the command line or in its config)."""
    if value is None:
        return HFGenerate()
    if isinstance(value, EngineConfig):
        if type(value).build is EngineConfig.build:  # found at the first rollout, as a 116-line traceback
            raise ConfigError(
                f"{ENGINE_KEY}: {type(value).__name__} does not say how to build its engine: define "
                "build(self, module) returning a lit_rl.rollout.RolloutEngine (docs/rollouts.md, Your own engine)"
            )
        return value
    if isinstance(value, dict) and "class_path" in value:
        name = str(value["class_path"]).rsplit(".", 1)[-1]
        cls = BUILT_IN_ENGINES.get(name)
        if cls is None or not str(value["class_path"]).startswith("lit_rl."):
            raise ConfigError(
                f"{ENGINE_KEY}: {value['class_path']} is not one of lit-rl's engines; a checkpoint imports no code, "
                "so give the engine again (--model.rollout.engine ...)"
            )
        init_args = dict(value.get("init_args") or {})
        unknown = sorted(set(init_args) - set(inspect.signature(cls.__init__).parameters))
        if unknown:
            raise ConfigError(f"{ENGINE_KEY}.{unknown[0]}: unknown option of {cls.__name__}")
        return cls(**init_args)
    raise ConfigError(f"{ENGINE_KEY} must be an engine config (HFGenerate, VLLMColocate, VLLMServer), got {value!r}")


def engine_of_0_1(vllm: Optional[dict[str, Any]]) -> dict[str, Any]:
    """lit-rl 0.1's `model.vllm` mapping (None: HF `generate`) as the `model.rollout.engine` it means now."""
    if vllm is None:
        return HFGenerate().as_config()
    options = dict(vllm)
    # Without `mode` (an overlay over a file that set it), a server's or a transfer's key says which it was.
    server_keys = {*_TRANSFER_FIELDS.values(), *inspect.signature(VLLMServer.__init__).parameters} - {"dtype"}
    server_keys -= set(inspect.signature(VLLMColocate.__init__).parameters)
    mode = options.pop("mode", "server" if server_keys & set(options) else "colocate")
    cls = VLLMServer if mode == "server" else VLLMColocate
    names = set(inspect.signature(cls.__init__).parameters) - {"self"}
    transfer = {new: options.pop(old) for new, old in _TRANSFER_FIELDS.items() if old in options}
    init_args = {key: value for key, value in options.items() if key in names}
    if cls is VLLMServer and transfer:
        init_args["transfer"] = transfer
    return {"class_path": class_path(cls), "init_args": init_args}


def dropped_0_1_options(vllm: Optional[dict[str, Any]]) -> list[str]:
    """The keys of a 0.1 `model.vllm` mapping its engine does not take (the other mode's, which it never read)."""
    if not vllm:
        return []
    engine = engine_of_0_1(vllm)
    kept = {*engine["init_args"], *engine["init_args"].get("transfer", {})}
    kept = {_TRANSFER_FIELDS.get(key, key) for key in kept}
    return sorted(key for key in vllm if key != "mode" and key not in kept)


def engine_key_of_0_1(field: Optional[str]) -> str:
    """Where lit-rl 0.1's `model.vllm.<field>` is now, under `model.rollout` (`engine.transfer.method` for
    `weight_transfer`); `mode` and the whole `vllm` are the engine's class."""
    if field is None or field == "mode":
        return "engine (VLLMColocate or VLLMServer: --config configs/rollout/vllm_colocate.yaml or vllm_server.yaml)"
    transfer = {old: new for new, old in _TRANSFER_FIELDS.items()}
    return f"engine.transfer.{transfer[field]}" if field in transfer else f"engine.{field}"
