"""Run as a script: 2 CPU processes (gloo) shard the tiny model with FSDP (FULL_SHARD, one unit per decoder layer,
the root wrapping a container the way Lightning wraps the LightningModule), stream the policy's weights with
`policy_weight_stream` and compare them, while they are gathered, with the plain model's. Prints one JSON line per
setting: `{"root": bool, "names": bool, "values": bool}` for gathering from the FSDP root or from the policy alone.

    python tests/integration/fsdp_stream_check.py
"""

from __future__ import annotations

import json
import os
import sys

import torch


def rank_main(rank: int, world: int, port: int, use_root: bool, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    from benchmarks.process_exit import exit_without_finalizing
    from lit_rl.modeling.models import load_causal_lm
    from lit_rl.rollout.weights import policy_weight_stream

    model = "lit-rl/tiny-qwen2-addition-sft"
    expected = list(load_causal_lm(model).state_dict().items())
    container = torch.nn.Module()
    container.policy = load_causal_lm(model)
    root = FSDP(
        container,
        auto_wrap_policy=ModuleWrapPolicy({Qwen2DecoderLayer}),
        use_orig_params=True,
        device_id=torch.device("cpu"),
    )
    # FSDP frees a gathered weight's storage when the stream moves on: compare each one while it is whole.
    names, values = [], True
    stream = policy_weight_stream(container.policy, 2**16, fsdp_root=root if use_root else None)
    for (name, tensor), (expected_name, expected_tensor) in zip(stream, expected, strict=True):
        names.append(name == expected_name)
        values = values and tensor.shape == expected_tensor.shape and torch.equal(tensor, expected_tensor)
    if rank == 0:
        with open(out, "w") as handle:
            json.dump({"root": use_root, "names": all(names), "values": values}, handle)
    dist.barrier()
    dist.destroy_process_group()
    exit_without_finalizing()  # aborted rank 0 once in CI without it: see its docstring


def main() -> None:
    import tempfile

    import torch.multiprocessing as mp

    from lit_rl.rollout.server.client import free_port

    with tempfile.TemporaryDirectory() as tmp:
        for use_root in (True, False):
            out = os.path.join(tmp, f"{use_root}.json")
            mp.start_processes(rank_main, args=(2, free_port(), use_root, out), nprocs=2, start_method="spawn")
            with open(out) as handle:
                print(handle.read(), flush=True)


if __name__ == "__main__":
    sys.exit(main())
