"""Peak extra memory of a weight push under ZeRO-3: the whole gather against `policy_weight_stream`'s buckets.

    python benchmarks/push_memory.py --out benchmarks/results/push_memory_cpu.json   # 21M model, 2 ranks
    python benchmarks/push_memory.py --quick                                          # the tiny model
    python benchmarks/push_memory.py --markdown benchmarks/results/push_memory_cpu.json  # the README's table

Two processes (gloo) hold a randomly initialised Qwen2 partitioned by `deepspeed.zero.Init`, as training under
ZeRO-3 does. Each push sends every weight, by Hugging Face name, into a sink that copies it into tensors
allocated beforehand (an engine holding its own copy of the weights, as vLLM does). Measured per rank: the peak
resident set size during the push minus the resident size before it (the kernel's high-water mark, reset before
each push through /proc/self/clear_refs), the largest over ranks and over `--pushes` pushes after a warm-up one.

- `whole`: the pre-bucketing path, every parameter gathered at once (`gathered_parameters`), then pushed.
- `bucket N MiB`: `policy_weight_stream(model, N MiB)`: one bucket gathered at a time.

The claim checked: a bucketed push's extra memory is at most about one bucket (or the largest block, a decoder
layer, when that is bigger) plus the largest tensor. glibc's malloc is pinned to fixed mmap thresholds so freed
buffers go back to the kernel instead of staying in the heap, and RSS reads what is live.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from provenance import parse_report_args, publish  # noqa: E402

MIB = 2**20
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}


def rss_bytes(field: str) -> int:
    """`VmRSS` or `VmHWM` (the peak since the last reset) of this process, in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(push) -> int:
    """Bytes the resident set grew to, at its peak, above where it was, while `push()` ran."""
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # reset VmHWM to the current RSS
    before = rss_bytes("VmRSS")
    push()
    return rss_bytes("VmHWM") - before


def rank_main(rank: int, world: int, port: int, sizes: dict, buckets_mib: list[float], pushes: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(LOCAL_RANK=str(rank))
    import deepspeed
    import torch
    from process_exit import exit_without_finalizing
    from support import policy_weights
    from transformers import AutoModelForCausalLM
    from transformers.integrations.deepspeed import HfDeepSpeedConfig

    from lit_rl.modeling.models import tiny_qwen2_config
    from lit_rl.rollout.weights import policy_weight_stream, weight_blocks
    from lit_rl.training.strategies import gathered_parameters

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    torch.manual_seed(0)
    ds_config = {"train_batch_size": world, "zero_optimization": {"stage": 3}}
    hf_config = HfDeepSpeedConfig(ds_config)  # transformers then builds (and initialises) inside zero.Init
    model = AutoModelForCausalLM.from_config(tiny_qwen2_config(**sizes))
    assert all(hasattr(p, "ds_id") for p in model.parameters()), "the model is not partitioned"
    del hf_config
    with gathered_parameters(model):  # the engine's own copy of the weights, allocated and touched up front
        sink = {name: tensor.clone() for name, tensor in policy_weights(model)}

    def load(named_tensors) -> None:
        for name, tensor in named_tensors:
            sink[name].copy_(tensor)

    def whole() -> None:
        with gathered_parameters(model):
            load(policy_weights(model))

    configs = [("whole", None, whole)]
    for mib in buckets_mib:
        configs.append((f"bucket {mib:g} MiB", mib, lambda mib=mib: load(policy_weight_stream(model, int(mib * MIB)))))
    result = {"rank": rank, "pushes": {}}
    for name, _, push in configs:
        push()  # warm-up: first-touch allocations of the collectives
        result["pushes"][name] = max(measure(push) for _ in range(pushes))
    blocks = weight_blocks(model)
    result["model_bytes"] = sum(b.full_bytes for b in blocks)
    result["largest_block_bytes"] = max(b.full_bytes for b in blocks)
    result["largest_tensor_bytes"] = max(p.ds_numel * p.element_size() for p in model.parameters())
    result["parameters"] = sum(p.ds_numel for p in model.parameters())
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    torch.distributed.destroy_process_group()
    exit_without_finalizing()  # the last gather ended just now: see its docstring


def run(sizes: dict, buckets_mib: list[float], pushes: int, workdir: Path, world: int = 2) -> list[dict]:
    import torch.multiprocessing as mp

    from lit_rl.rollout.server.client import free_port

    os.environ.update(MALLOC_ENV)  # read by glibc when each rank's process starts
    mp.start_processes(
        rank_main,
        args=(world, free_port(), sizes, buckets_mib, pushes, str(workdir)),
        nprocs=world,
        start_method="spawn",
    )
    ranks = [json.loads((workdir / f"rank{rank}.json").read_text()) for rank in range(world)]
    first = ranks[0]
    results = []
    for name in first["pushes"]:
        bucket = None if name == "whole" else float(name.split()[1])
        extra = max(r["pushes"][name] for r in ranks)
        bound = None
        if bucket is not None:
            bound = max(bucket * MIB, first["largest_block_bytes"]) + first["largest_tensor_bytes"]
        results.append(
            {
                "push": name,
                "bucket_mib": bucket,
                "extra_mib": extra / MIB,
                "bound_mib": None if bound is None else bound / MIB,
                "model_mib": first["model_bytes"] / MIB,
                "largest_block_mib": first["largest_block_bytes"] / MIB,
                "largest_tensor_mib": first["largest_tensor_bytes"] / MIB,
                "parameters": first["parameters"],
                "ranks": world,
            }
        )
    return results


def markdown_table(results: list[dict]) -> str:
    """The README's table of a results file (a test checks the README carries exactly this)."""
    lines = [
        "| push | peak extra MiB per rank | bound: max(bucket, largest layer) + largest tensor, MiB | model MiB |",
        "|---|---|---|---|",
    ]
    for r in results:
        bound = "" if r["bound_mib"] is None else f"{r['bound_mib']:.1f}"
        lines.append(f"| {r['push']} | {r['extra_mib']:.1f} | {bound} | {r['model_mib']:.1f} |")
    return "\n".join(lines)


def claims(results: list[dict]) -> list[str]:
    """The README's prose numbers of a results file (a test checks the README says them)."""
    whole = next(r for r in results if r["bound_mib"] is None)
    buckets = [r for r in results if r["bound_mib"] is not None]
    over = max(100 * (r["extra_mib"] / r["bound_mib"] - 1) for r in buckets)
    return [
        f"The whole gather holds the model again ({whole['extra_mib']:.1f} MiB for an {whole['model_mib']:.1f} MiB "
        f"model)",
        f"one decoder layer ({whole['largest_block_mib']:.1f} MiB) when the bucket is smaller, plus the largest tensor "
        f"({whole['largest_tensor_mib']:.0f} MiB), at most {max(over, 0):.0f}% above that bound",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--buckets-mib", type=float, nargs="+", default=[4.0, 16.0, 32.0])
    parser.add_argument("--pushes", type=int, default=3)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the tiny model (1M parameters), buckets of 0.5 MiB, the largest of 3 pushes",
    )
    args = parse_report_args(parser, markdown_table, claims)
    import tempfile

    sizes = dict(hidden_size=512, num_hidden_layers=8, intermediate_size=1024)  # the 21M benchmark model
    if args.quick:
        sizes, args.buckets_mib, args.pushes = {}, [0.5], 3
    with tempfile.TemporaryDirectory(prefix="lit-rl-push-memory-") as tmp:
        results = run(sizes, args.buckets_mib, args.pushes, Path(tmp))
    publish(args, results, markdown_table, claims)


if __name__ == "__main__":
    main()
