"""What lit-rl's two vLLM engine configs (`VLLMColocate`, `VLLMServer` in `lit_rl.rollout.engine_config`) share:
vLLM's dtype names, the weight transfers, and the checks of each config's options, which name the user's keys
(`model.rollout.engine.<option>`). Each option is declared once, in its config class's signature. Plain data:
importing it imports no vLLM."""

from __future__ import annotations

import importlib.util
import math
import urllib.parse
from typing import TYPE_CHECKING, Any, Literal, Optional, get_args

import torch

from lit_rl.errors import ConfigError

if TYPE_CHECKING:
    from lit_rl.rollout.engine_config import VLLMColocate, VLLMServer

# vLLM's dtype names (`model.rollout.engine.dtype`) as torch dtypes; the first name of each dtype is the one lit-rl
# passes.
VLLM_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float": torch.float32,
    "half": torch.float16,
}

TransferMethod = Literal["auto", "file", "http", "gloo", "nccl"]  # `model.rollout.engine.transfer.method`
COLLECTIVE_TRANSFERS = ("gloo", "nccl")  # `transfer.method`s that broadcast to the servers' workers
OnServerFailure = Literal["fail", "continue"]  # `model.rollout.engine.on_server_failure`
LoraWeights = Literal["adapter", "merged"]  # `model.rollout.engine.lora_weights`
# The backend a server's `--weight-transfer-config` names for each of them.
VLLM_TRANSFER_BACKENDS = {"gloo": "lit_rl_gloo", "nccl": "nccl"}
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
KEY = "model.rollout.engine"


def check_push_bucket(push_bucket_mib: float) -> None:
    if not (0 < push_bucket_mib < math.inf):
        raise ConfigError(f"{KEY}.push_bucket_mib must be a finite number of MiB > 0, got {push_bucket_mib}")


def check_colocate(config: VLLMColocate) -> None:
    """Reject impossible settings of the colocated engine, naming the offending `model.rollout.engine.<option>`."""
    if not 0 < config.gpu_memory_utilization <= 1:
        raise ConfigError(f"{KEY}.gpu_memory_utilization must be in (0, 1], got {config.gpu_memory_utilization}")
    if config.tensor_parallel_size < 1:
        raise ConfigError(f"{KEY}.tensor_parallel_size must be >= 1, got {config.tensor_parallel_size}")
    check_push_bucket(config.push_bucket_mib)
    if config.max_model_len is not None and config.max_model_len < 1:
        raise ConfigError(f"{KEY}.max_model_len must be >= 1, got {config.max_model_len}")
    if config.cpu_kvcache_space_gib < 1:
        raise ConfigError(f"{KEY}.cpu_kvcache_space_gib must be >= 1 (whole GiB), got {config.cpu_kvcache_space_gib}")


def _one_of(choices: Any) -> str:
    """A `Literal`'s values as a message lists them: `fail or continue`, `auto, file, http, gloo or nccl`."""
    names = [str(name) for name in get_args(choices)]
    return f"{', '.join(names[:-1])} or {names[-1]}"


def check_server(config: VLLMServer) -> None:
    """Reject impossible settings of the server engine, naming the offending `model.rollout.engine.<option>`."""
    check_push_bucket(config.push_bucket_mib)
    if not config.server_url.startswith(("http://", "https://")):
        raise ConfigError(f"{KEY}.server_url must start with http:// or https://, got {config.server_url!r}")
    if not (0 < config.request_timeout_s < math.inf):
        raise ConfigError(
            f"{KEY}.request_timeout_s must be a finite number of seconds > 0, got {config.request_timeout_s}"
        )
    if not (0 <= config.wait_for_server_s < math.inf):
        raise ConfigError(
            f"{KEY}.wait_for_server_s must be a finite number of seconds >= 0, got {config.wait_for_server_s}"
        )
    if config.max_retries < 0:
        raise ConfigError(f"{KEY}.max_retries must be >= 0, got {config.max_retries}")
    transfer = config.transfer
    if transfer.method not in get_args(TransferMethod):
        raise ConfigError(f"{KEY}.transfer.method must be {_one_of(TransferMethod)}, got {transfer.method!r}")
    _check_server_lists(config)
    if config.broadcasts_weights:
        _check_collective_transfer(config)
        return
    if transfer.method == "http" and transfer.receiver_url is None and transfer.receiver_urls is None:
        raise ConfigError(
            f"{KEY}.transfer.method: http needs {KEY}.transfer.receiver_url, the weight receiver beside the server "
            "(python -m lit_rl.rollout.server.weight_receiver --dir DIR --port 8010 on the server's machine)"
        )
    if transfer.receiver_url is not None and not transfer.receiver_url.startswith(("http://", "https://")):
        raise ConfigError(
            f"{KEY}.transfer.receiver_url must start with http:// or https://, got {transfer.receiver_url!r}"
        )
    remote = _server_elsewhere(config)
    if not config.uploads_weights and transfer.sync_dir is None and remote:
        raise ConfigError(
            f"{KEY}.server_url {remote} is not on this machine: its weights cannot go through a local /dev/shm "
            f"directory. Run the weight receiver beside it and set {KEY}.transfer.receiver_url, or set "
            f"{KEY}.transfer.sync_dir to a file system both machines share"
        )


def _server_elsewhere(config: VLLMServer) -> Optional[str]:
    """The first server URL whose host is not this machine (127.0.0.1, localhost, ::1), or None."""
    for url, _ in config.server_endpoints():
        if (urllib.parse.urlparse(url).hostname or "") not in LOCAL_HOSTS:
            return url
    return None


def _check_server_lists(config: VLLMServer) -> None:
    """`server_urls`, `transfer.receiver_urls` and `on_server_failure`, each named when wrong."""
    failure = config.on_server_failure
    if failure not in get_args(OnServerFailure):
        raise ConfigError(f"{KEY}.on_server_failure must be {_one_of(OnServerFailure)}, got {failure!r}")
    receiver_urls = config.transfer.receiver_urls
    for key, urls in (("server_urls", config.server_urls), ("transfer.receiver_urls", receiver_urls)):
        if urls is None:
            continue
        if isinstance(urls, str) or not urls:
            raise ConfigError(f"{KEY}.{key} must be a non-empty list of URLs, got {urls!r}")
        for url in urls:
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ConfigError(f"{KEY}.{key}: each URL must start with http:// or https://, got {url!r}")
        if key == "server_urls" and len({url.rstrip("/") for url in urls}) != len(urls):
            raise ConfigError(f"{KEY}.server_urls lists a server twice: {urls}")
    if receiver_urls is not None:
        if config.server_urls is None or len(receiver_urls) != len(config.server_urls):
            raise ConfigError(
                f"{KEY}.transfer.receiver_urls needs {KEY}.server_urls with as many entries (one receiver per server, "
                f"in the same order); got {len(receiver_urls)} for "
                f"{len(config.server_urls) if config.server_urls else 'no'} server_urls"
            )
        if config.transfer.receiver_url is not None:
            raise ConfigError(f"set {KEY}.transfer.receiver_url or {KEY}.transfer.receiver_urls, not both")


def _check_collective_transfer(config: VLLMServer) -> None:
    """`transfer.method: gloo | nccl`: no receiver to upload to, a port in range, and an address other machines
    can reach when a server is on one."""
    transfer = config.transfer
    if transfer.receiver_url is not None or transfer.receiver_urls is not None:
        raise ConfigError(
            f"{KEY}.transfer.receiver_url(s) is for transfer.method: http; with {transfer.method} the weights are "
            "broadcast to the servers' workers: unset it"
        )
    if transfer.address in ("0.0.0.0", "::", ""):
        raise ConfigError(
            f"{KEY}.transfer.address must be this machine's address as the servers reach it, not {transfer.address!r}"
        )
    if transfer.method == "nccl":
        if not torch.cuda.is_available():
            raise ConfigError(f"{KEY}.transfer.method: nccl needs a CUDA GPU beside the trainer; use gloo")
        if importlib.util.find_spec("vllm") is None:
            raise ConfigError(f"{KEY}.transfer.method: nccl needs vLLM installed beside the trainer; use gloo")
    if not 0 <= transfer.port <= 65535:
        raise ConfigError(f"{KEY}.transfer.port must be in 0..65535 (0: free ports), got {transfer.port}")
    servers = len(config.server_endpoints())
    if transfer.port and transfer.port + servers - 1 > 65535:
        raise ConfigError(
            f"{KEY}.transfer.port {transfer.port} leaves no port for each of the {servers} servers (one port each, "
            "counting up)"
        )
    remote = _server_elsewhere(config)
    if transfer.address in LOCAL_HOSTS and remote:
        raise ConfigError(
            f"{KEY}.server_url {remote} is not on this machine: set {KEY}.transfer.address to this machine's address "
            f"that it can reach (the weights' rendezvous), not {transfer.address}"
        )
