"""The receiving end of `model.rollout.engine.transfer.method: gloo`, run inside a vLLM server's workers: a
weight-transfer engine for vLLM's weight-transfer endpoints that works without a GPU.

vLLM's own engines (`nccl`, `ipc`, ...) need CUDA. This one joins a gloo group with the trainer's rank 0 (which
hosts the rendezvous at `master_address:master_port`) and receives each chunk the trainer announces by name, dtype
and shape with one broadcast per tensor, loading them through vLLM's layerwise reload, as the NCCL engine does.

It reaches vLLM as a plugin: lit-rl's `vllm.general_plugins` entry point (`register`) adds the backend
`lit_rl_gloo` in every vLLM process of an environment where lit-rl is installed (registering imports nothing
heavy; this module is imported only by a server started with `--weight-transfer-config '{"backend":
"lit_rl_gloo"}'`). The trainer's side is `lit_rl.rollout.server.collective_transfer`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
from vllm.distributed.utils import stateless_init_torch_distributed_process_group
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

BACKEND = "lit_rl_gloo"


def register() -> None:
    """vLLM's plugin hook (entry point `vllm.general_plugins`): add the `lit_rl_gloo` backend, lazily, once; before
    the process builds its model, settle MKL's math kernels (`lit_rl/numerics.py`: vLLM's rotary table); and in a
    server lit-rl started, drop the notices of every weight push from its log (`lit_rl.console`)."""
    import os

    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from lit_rl.console import QUIET_SERVER_ENV, WEIGHT_PUSH_MESSAGES, drop_log_messages
    from lit_rl.numerics import settle_cpu_math_kernels

    settle_cpu_math_kernels()
    if os.environ.get(QUIET_SERVER_ENV) == "1":
        drop_log_messages(WEIGHT_PUSH_MESSAGES)

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


MAX_NAME_CHARS = 1024
MAX_DIMS = 8


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One chunk: the tensors that follow, one broadcast each, in this order. Checked on arrival (anyone who
    reaches a dev-mode server can send one): names are strings of at most `MAX_NAME_CHARS`, dtypes torch's, shapes
    lists of at most `MAX_DIMS` sizes >= 0; their sizes against the model, by `UpdateBudget`."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not all(isinstance(field, list) for field in (self.names, self.dtype_names, self.shapes)):
            raise ValueError("names, dtype_names and shapes must be lists")
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"names, dtype_names and shapes differ in length: {len(self.names)}, {len(self.dtype_names)}, "
                f"{len(self.shapes)}"
            )
        for name, dtype_name, shape in zip(self.names, self.dtype_names, self.shapes):
            if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
                raise ValueError(f"a tensor name must be a string of 1 to {MAX_NAME_CHARS} characters: {name!r:.80}")
            if not isinstance(dtype_name, str) or not isinstance(getattr(torch, dtype_name, None), torch.dtype):
                raise ValueError(f"{name}: not a torch dtype: {dtype_name!r:.40}")
            sizes_ok = isinstance(shape, list) and len(shape) <= MAX_DIMS
            if not sizes_ok or not all(type(size) is int and size >= 0 for size in shape):
                raise ValueError(f"{name}: shape {shape!r:.80} is not a list of at most {MAX_DIMS} sizes >= 0")


class UpdateBudget:
    """What one update (a start to its finish) may still bring into this worker, in bytes, from the model it loads
    into: no tensor and no update larger than the whole model (an update: twice, for what a worker does not hold,
    such as the embeddings of a middle pipeline stage), no floating dtype wider than the model's widest or float32,
    no name twice. The model's bytes are counted at float32 at least, as a float32 trainer pushes into a bfloat16
    server; a wider dtype would otherwise multiply what the elements allocate. A worker holds a slice of the model:
    the whole is at most `shards` such slices, `shards` being the number of workers it is split over (tensor,
    pipeline and data parallel). So a request cannot make a worker allocate more than about a legitimate push does,
    whatever dtypes and shapes it names; the loader itself refuses a name the model does not have."""

    def __init__(self, model: torch.nn.Module, shards: int) -> None:
        tensors = (*model.parameters(), *model.buffers())
        floats = [t.element_size() for t in tensors if t.is_floating_point()]
        self.max_float_bytes = max([4, *floats])  # bytes per element of the widest floating dtype taken
        whole = shards * sum(t.numel() * max(t.element_size(), 4 if t.is_floating_point() else 0) for t in tensors)
        self.max_bytes = whole
        self.left_bytes = 2 * whole
        self.names: set[str] = set()

    def take(self, info: GlooUpdateInfo) -> None:
        """Count a chunk against the budget, or raise ValueError naming its first tensor over it (nothing counted)."""
        left, seen = self.left_bytes, set()
        for name, dtype_name, shape in zip(info.names, info.dtype_names, info.shapes):
            dtype = getattr(torch, dtype_name)
            if dtype.is_floating_point and dtype.itemsize > self.max_float_bytes:
                widest = self.max_float_bytes
                raise ValueError(f"{name}: {dtype_name} is wider than the model's floats ({widest} bytes)")
            nbytes = math.prod(shape) * dtype.itemsize
            if name in self.names or name in seen:
                raise ValueError(f"{name}: sent twice in one weight update")
            if nbytes > self.max_bytes:
                raise ValueError(f"{name}: {nbytes} bytes, more than the whole model ({self.max_bytes})")
            if nbytes > left:
                raise ValueError(f"{name}: the update would bring more than twice the model's bytes")
            left -= nbytes
            seen.add(name)
        self.left_bytes = left
        self.names |= seen


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Receives dense checkpoint-format weights over gloo and loads them layer by layer (see the module docstring)."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group = None
        self.budget: Optional[UpdateBudget] = None  # set by each start_weight_update

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

        parallel = self.parallel_config
        shards = parallel.tensor_parallel_size * parallel.pipeline_parallel_size * parallel.data_parallel_size
        initialize_layerwise_reload(self.model)
        # Counted after: the reload restores the parameters as they are loaded (a backend may keep them repacked
        # elsewhere in between: vLLM's CPU one leaves empty tensors in their place).
        self.budget = UpdateBudget(self.model, shards)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        self.budget = None
        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronizes the accelerator afterwards; gloo's receives have landed when they return, and
        # a CPU server has no accelerator to synchronize.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("lit_rl_gloo weight transfer is not initialized: call init_weight_transfer_engine")
        if self.budget is None:
            raise RuntimeError("lit_rl_gloo: update_weights without start_weight_update")
        self.budget.take(update_info)  # the whole chunk checked before anything is allocated
        options = torch.distributed.BroadcastOptions()
        options.rootRank = 0
        for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype_name))
            self.group.broadcast([tensor], options).wait()
            self.model.load_weights([(name, tensor.to(self.device))])

    def shutdown(self) -> None:
        self.group = None
