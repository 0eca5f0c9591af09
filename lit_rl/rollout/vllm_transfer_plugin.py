"""The receiving end of `model.vllm.weight_transfer: gloo`, run inside a vLLM server's workers: a weight-transfer
engine for vLLM's weight-transfer endpoints that works without a GPU.

vLLM's own engines (`nccl`, `ipc`, ...) need CUDA. This one joins a gloo group with the trainer's rank 0 (which
hosts the rendezvous at `master_address:master_port`) and receives each chunk the trainer announces by name, dtype
and shape with one broadcast per tensor, loading them through vLLM's layerwise reload, as the NCCL engine does.

It reaches vLLM as a plugin: lit-rl's `vllm.general_plugins` entry point (`register`) adds the backend
`lit_rl_gloo` in every vLLM process of an environment where lit-rl is installed (registering imports nothing
heavy; this module is imported only by a server started with `--weight-transfer-config '{"backend":
"lit_rl_gloo"}'`). The trainer's side is `lit_rl.rollout.collective_transfer`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from vllm.distributed.utils import stateless_init_torch_distributed_process_group
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

BACKEND = "lit_rl_gloo"


def register() -> None:
    """vLLM's plugin hook (entry point `vllm.general_plugins`): add the `lit_rl_gloo` backend, lazily, once."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "GlooWeightTransferEngine")
    except ValueError:  # already registered: plugins may load more than once per process
        pass


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """Where the trainer's rank 0 hosts the group's rendezvous; this worker is rank `rank_offset + its rank`."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = 300.0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One chunk: the tensors that follow, one broadcast each, in this order."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"names, dtype_names and shapes differ in length: {len(self.names)}, {len(self.dtype_names)}, "
                f"{len(self.shapes)}"
            )
        for name in self.dtype_names:
            if not isinstance(getattr(torch, name, None), torch.dtype):
                raise ValueError(f"not a torch dtype: {name!r}")


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Receives dense checkpoint-format weights over gloo and loads them layer by layer (see the module docstring)."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        self.group = None  # a new trainer (or the same one, after a failure) replaces the old group
        parallel = self.parallel_config
        rank = init_info.rank_offset + parallel.data_parallel_index * parallel.world_size + parallel.rank
        self.group = stateless_init_torch_distributed_process_group(
            init_info.master_address,
            init_info.master_port,
            rank,
            init_info.world_size,
            "gloo",
            timeout=timedelta(seconds=init_info.timeout_s),
        )

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronizes the accelerator afterwards; gloo's receives have landed when they return, and
        # a CPU server has no accelerator to synchronize.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("lit_rl_gloo weight transfer is not initialized: call init_weight_transfer_engine")
        options = torch.distributed.BroadcastOptions()
        options.rootRank = 0
        for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype_name))
            self.group.broadcast([tensor], options).wait()
            self.model.load_weights([(name, tensor.to(self.device))])

    def shutdown(self) -> None:
        self.group = None
