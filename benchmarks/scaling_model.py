"""A scaling model of a synchronous (or one-step-stale) GRPO step, checked against measured runs, and a projection.

    python benchmarks/scaling_model.py --devices 1 2 4 8 --out benchmarks/results/scaling_cpu.json
    python benchmarks/scaling_model.py --markdown benchmarks/results/scaling_cpu.json   # the README's tables

**The model** (`predict`). A step of `C` completions on `N` trainer devices (each `C / N` of them) and `M` rollout
servers (`M = 0`: every trainer device generates its own, colocated):

    step = push + generation + reward + logprobs + update + allreduce + sync          (synchronous)
    step = max(generation, reward + logprobs + update + allreduce + sync) + push      (one step stale, M > 0)

    generation = (C / N) * g / (r_gen * s)        colocated        | C * g / (M * r_gen)       servers
    reward     = (C / N) * t_reward / s
    logprobs   = (C / N) * k * T / (r_fwd * s)    k forward-only passes (old and reference log-probs)
    update     = (C / N) * T / (r_train * s)      forward, backward and optimizer of the policy
    allreduce  = a(N) + b(N) * bytes(grad)        0 for N = 1
    sync       = c * l(N)                         c small collectives a step (metrics, flags), l(N) the latency of one
    push       = bytes(weights) / r_push

with `g` tokens generated and `T` trained (prompt and completion) per completion, rates per device, and `s` the
share of a device each trainer process gets: 1 on GPUs; on CPU, where `N` processes of one thread share `P` cores,
`s = min(1, P / N) * e(min(N, P))`, `e(k)` being how fast each of `k` busy cores computes against one alone (shared
memory bandwidth and caches; 1 for one).

**Inputs, measured** (`check`): the per-phase rates come from one 1-process DDP run of the config (one thread; DDP
like the runs it predicts, so its per-step overhead is in the inputs), through `throughput.py`'s `perf/` metrics;
`a(N)` and `b(N)` are fitted to timed gloo all-reduces of 1 KiB to 16 MiB with `N` one-thread processes on this
machine, `l(N)` being the 1 KiB one; `c` is counted (every `torch.distributed` call of a 2-process run, per step;
DDP's gradient all-reduce is not one of them); `e(k)` is timed with the policy's forward and backward on a fixed
batch in `k` processes at once; `bytes(grad)` is the policy's fp32 parameters. **Checked**: the same config on
`N = 2, 4, 8` DDP processes (the same completions per process), measured step time against predicted, with the
error in percent.

**The projection** (`PROJECTION_7B`) feeds the same formula with stated inputs for a 7B GRPO run on 2 nodes x 8
H100 GPUs: none of them is measured here (no GPU); each says where it comes from.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from provenance import parse_report_args, publish  # noqa: E402

ALLREDUCE_SIZES = [2**k for k in range(10, 25, 2)]  # 1 KiB .. 16 MiB
COUNT_MODE = "--count-collectives"  # internal: `lit-rl fit` with every collective counted (DDP relaunches argv)
COUNT_OUT = "LIT_RL_COLLECTIVES_OUT"
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list", "barrier")
COLLECTIVES += ("gather", "gather_object", "scatter", "scatter_object_list", "reduce", "all_to_all")


@dataclass
class Inputs:
    """What `predict` needs; rates are tokens (or bytes) per second per device, times are seconds."""

    generated_tokens: float  # g: per completion
    trained_tokens: float  # T: prompt + completion, per completion
    logprob_passes: float  # k: forward-only passes over T per completion (old and reference log-probs)
    generation_tokens_per_s: float  # r_gen: a colocated trainer device, or one server
    train_tokens_per_s: float  # r_train
    forward_tokens_per_s: float  # r_fwd
    reward_s: float  # t_reward: per completion, on the trainer's CPU
    grad_bytes: float
    push_bytes: float
    push_bytes_per_s: float  # r_push (inf: no push, HF generate samples from the policy itself)
    allreduce: dict[int, tuple[float, float]] = field(default_factory=dict)  # N -> (a seconds, b seconds per byte)
    collectives_per_step: float = 0.0  # c
    collective_latency: dict[int, float] = field(default_factory=dict)  # N -> l(N) seconds
    cores: Optional[int] = None  # P: CPU cores the trainer processes share; None: one device each (GPUs)
    core_efficiency: dict[int, float] = field(default_factory=dict)  # k busy cores -> speed of each, vs 1 busy

    def share(self, n: int) -> float:
        """The part of a device one of `n` trainer processes computes at (`s` in the module docstring)."""
        if not self.cores:
            return 1.0
        busy = min(n, self.cores)
        return min(1.0, self.cores / n) * self.core_efficiency.get(busy, 1.0)

    def allreduce_s(self, n: int) -> float:
        if n == 1:
            return 0.0
        latency, per_byte = self.allreduce[n]
        return latency + per_byte * self.grad_bytes


def predict(inputs: Inputs, completions: float, trainers: int, servers: int = 0, stale: bool = False) -> dict:
    """Seconds per step and per phase, and tokens/s, for `completions` per step (see the module docstring)."""
    share = inputs.share(trainers)
    per_rank = completions / trainers
    if servers:
        generation = completions * inputs.generated_tokens / (servers * inputs.generation_tokens_per_s)
    else:
        generation = per_rank * inputs.generated_tokens / (inputs.generation_tokens_per_s * share)
    phases = {
        "generation": generation,
        "reward": per_rank * inputs.reward_s / share,
        "logprobs": per_rank * inputs.logprob_passes * inputs.trained_tokens / (inputs.forward_tokens_per_s * share),
        "update": per_rank * inputs.trained_tokens / (inputs.train_tokens_per_s * share),
        "allreduce": inputs.allreduce_s(trainers),
        "sync": inputs.collectives_per_step * inputs.collective_latency.get(trainers, 0.0),
        "push": inputs.push_bytes / inputs.push_bytes_per_s,
    }
    trainer_side = sum(phases[name] for name in ("reward", "logprobs", "update", "allreduce", "sync"))
    if stale and servers:
        step = max(phases["generation"], trainer_side) + phases["push"]
    else:
        step = sum(phases.values())
    return {
        "step_s": step,
        "phases_s": phases,
        "generated_tokens_per_s": completions * inputs.generated_tokens / step,
        "trained_tokens_per_s": completions * inputs.trained_tokens / step,
    }


# -- measuring the inputs on this machine ----------------------------------------------------------------------------
def _allreduce_worker(rank: int, world: int, init_file: str, sizes: list[int], reps: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from process_exit import exit_without_finalizing

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    timings = {}
    for size in sizes:
        tensor = torch.ones(size // 4)
        for _ in range(3):
            dist.all_reduce(tensor)
        samples = []
        for _ in range(reps):
            dist.barrier()
            started = time.perf_counter()
            dist.all_reduce(tensor)
            samples.append(time.perf_counter() - started)
        timings[size] = statistics.median(samples)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(timings))
    exit_without_finalizing()


def measure_allreduce(world: int, reps: int = 15) -> dict:
    """Median seconds of one fp32 gloo all-reduce per size (bytes), with `world` one-thread processes, and the
    least-squares line through them: seconds = a + b * bytes."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="lit-rl-allreduce-") as tmp:
        out = os.path.join(tmp, "timings.json")
        mp.start_processes(
            _allreduce_worker,
            args=(world, os.path.join(tmp, "init"), ALLREDUCE_SIZES, reps, out),
            nprocs=world,
            start_method="spawn",
        )
        timings = {int(size): seconds for size, seconds in json.loads(Path(out).read_text()).items()}
    sizes, seconds = list(timings), list(timings.values())
    mean_x, mean_y = statistics.fmean(sizes), statistics.fmean(seconds)
    per_byte = sum((x - mean_x) * (y - mean_y) for x, y in zip(sizes, seconds)) / sum((x - mean_x) ** 2 for x in sizes)
    return {"seconds_by_bytes": timings, "latency_s": mean_y - per_byte * mean_x, "s_per_byte": per_byte}


def _busy_worker(rank: int, world: int, init_file: str, model: str, iterations: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    import transformers
    from process_exit import exit_without_finalizing

    from lit_rl.modeling.models import resolve_model_path

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.manual_seed(0)
    network = transformers.AutoModelForCausalLM.from_pretrained(resolve_model_path(model))
    ids = torch.randint(0, network.config.vocab_size, (64, 32))
    samples = []
    for iteration in range(iterations + 3):
        if iteration == 3:
            dist.barrier()  # all start measuring together: every core busy at once
        started = time.perf_counter()
        network(input_ids=ids, labels=ids).loss.backward()
        samples.append(time.perf_counter() - started)
    dist.barrier()
    dist.destroy_process_group()
    Path(out).with_suffix(f".{rank}").write_text(json.dumps(statistics.median(samples[3:])))
    exit_without_finalizing()


def measure_core_efficiency(model: str, cores: int, iterations: int = 20) -> dict[int, float]:
    """`e(k)` for k = 1..cores: seconds per forward and backward of the policy in one process alone, over the mean in
    `k` processes running it at once."""
    import torch.multiprocessing as mp

    seconds = {}
    for busy in range(1, cores + 1):
        with tempfile.TemporaryDirectory(prefix="lit-rl-cores-") as tmp:
            out = os.path.join(tmp, "seconds")
            mp.start_processes(
                _busy_worker,
                args=(busy, os.path.join(tmp, "init"), model, iterations, out),
                nprocs=busy,
                start_method="spawn",
            )
            per_process = [json.loads(Path(out).with_suffix(f".{r}").read_text()) for r in range(busy)]
            seconds[busy] = statistics.fmean(per_process)
    return {busy: seconds[1] / seconds[busy] for busy in seconds}


def fit_counting_collectives(fit_args: list[str]) -> None:
    """`lit-rl fit` with each `torch.distributed` collective counted; every rank writes its counts on exit."""
    import atexit
    from collections import Counter

    import torch.distributed as dist

    counts: Counter = Counter()
    for name in COLLECTIVES:
        original = getattr(dist, name)
        setattr(dist, name, lambda *a, _call=original, _name=name, **k: counts.update([_name]) or _call(*a, **k))
    rank = os.environ.get("LOCAL_RANK", "0")
    atexit.register(lambda: Path(f"{os.environ[COUNT_OUT]}.{rank}").write_text(json.dumps(counts)))
    from lit_rl.cli import main

    main(fit_args)


def count_collectives(config: Path, steps: int, workdir: Path) -> float:
    """Collectives per optimizer step of `config` on 2 DDP processes (rank 0's count over `steps` steps)."""
    import subprocess

    import throughput

    out = workdir / "collectives"
    command = [sys.executable, __file__, COUNT_MODE, "fit", "--config", str(config)]
    command += ["--config", str(REPO / "configs" / "strategy" / "ddp.yaml"), "--trainer.devices", "2"]
    command += ["--trainer.val_check_interval", "1000000", *throughput.fit_flags(steps, workdir, "collectives")]
    subprocess.run(command, cwd=REPO, env={**os.environ, COUNT_OUT: str(out)}, check=True, capture_output=True)
    return sum(json.loads(Path(f"{out}.0").read_text()).values()) / steps


def inputs_from_run(run: dict, completions: int, grad_bytes: float, cores: int) -> Inputs:
    """`Inputs` from one 1-process `throughput.py` run of `completions` per step (its means after warm-up)."""
    split, step = run["split_s"], run["step_s"]
    generated = run["generated_tokens_per_s"] * split["generation"]
    trained = run["trained_tokens_per_s"] * step
    forward_s = split["old_logprobs"] + split["ref_logprobs"]
    return Inputs(
        generated_tokens=generated / completions,
        trained_tokens=trained / completions,
        logprob_passes=1.0 if forward_s > 0 else 0.0,
        generation_tokens_per_s=run["generated_tokens_per_s"],
        train_tokens_per_s=trained / split["policy_update"],
        forward_tokens_per_s=trained / forward_s if forward_s > 0 else 1.0,
        reward_s=split["reward"] / completions,
        grad_bytes=grad_bytes,
        push_bytes=0.0,
        push_bytes_per_s=float("inf"),
        cores=cores,
    )


def parameter_bytes(model: str) -> int:
    """fp32 bytes of the policy's parameters: what DDP all-reduces as gradients every optimizer step."""
    import transformers

    from lit_rl.modeling.models import resolve_model_path

    config = transformers.AutoConfig.from_pretrained(resolve_model_path(model))
    with __import__("torch").device("meta"):
        network = transformers.AutoModelForCausalLM.from_config(config)
    return 4 * sum(p.numel() for p in network.parameters())


def check(args) -> dict:
    """Measure the inputs, run every device count, and set prediction against measurement."""
    import throughput
    import yaml

    os.environ["OMP_NUM_THREADS"] = "1"  # a process is one thread: a "device" is a core
    cores = len(os.sched_getaffinity(0))
    config = yaml.safe_load(args.config.read_text())["model"]["init_args"]
    per_rank = config["micro_batch_size"]
    run_args = argparse.Namespace(
        config=args.config, accelerator="cpu", steps=args.steps, warmup=args.warmup, pin_cores=False, overrides=[]
    )
    runs: dict[int, list[dict]] = {n: [] for n in args.devices}
    with tempfile.TemporaryDirectory(prefix="lit-rl-scaling-") as tmp:
        for round_ in range(args.rounds):  # interleaved: a noisy minute hits every device count alike
            for n in args.devices:
                print(f"round {round_ + 1}: GRPO on {n} process(es) ...", flush=True)
                row = throughput.run_one(run_args, "hf", "ddp", n, Path(tmp), 0, round_)
                if "error" in row:
                    raise SystemExit(f"{n} process(es) failed: {row['error']}")
                runs[n].append(row)
    median = {n: sorted(rows, key=lambda r: r["step_s"])[(len(rows) - 1) // 2] for n, rows in runs.items()}
    inputs = inputs_from_run(median[1], per_rank, parameter_bytes(config["model_name_or_path"]), cores)
    print("forward and backward on 1 .. all cores at once ...", flush=True)
    inputs.core_efficiency = measure_core_efficiency(config["model_name_or_path"], cores)
    with tempfile.TemporaryDirectory(prefix="lit-rl-collectives-") as tmp:
        inputs.collectives_per_step = count_collectives(args.config, args.steps, Path(tmp))
    allreduce = {}
    for n in args.devices:
        if n > 1:
            print(f"all-reduce on {n} processes ...", flush=True)
            allreduce[n] = measure_allreduce(n)
            inputs.allreduce[n] = (allreduce[n]["latency_s"], allreduce[n]["s_per_byte"])
            inputs.collective_latency[n] = allreduce[n]["seconds_by_bytes"][min(ALLREDUCE_SIZES)]
    rows = []
    for n in args.devices:
        predicted = predict(inputs, per_rank * n, n)
        measured = median[n]
        rows.append(
            {
                "devices": n,
                "completions_per_step": per_rank * n,
                "predicted_step_s": predicted["step_s"],
                "measured_step_s": measured["step_s"],
                "error_pct": 100 * (predicted["step_s"] - measured["step_s"]) / measured["step_s"],
                "predicted_phases_s": predicted["phases_s"],
                "measured_split_s": measured["split_s"],
                "rounds_step_s": [r["step_s"] for r in runs[n]],
            }
        )
    return {"check": rows, "inputs": asdict(inputs), "allreduce": allreduce, "config": str(args.config.name)}


# -- the 7B projection -------------------------------------------------------------------------------------------------
H100_BF16_FLOPS = 989e12  # dense bf16 peak, H100 SXM datasheet
H100_HBM_BYTES_PER_S = 3.35e12  # HBM3, H100 SXM datasheet
PARAMS_7B = 7.6e9  # Qwen2.5-7B
KV_BYTES_PER_TOKEN_7B = 28 * 2 * 4 * 128 * 2  # layers x (k, v) x kv heads x head dim x bf16 bytes
PROMPT, COMPLETION, DECODE_BATCH = 200, 600, 256  # tokens; sequences a server decodes at once
MFU = 0.35  # share of peak a 7B ZeRO/FSDP update reaches (a typical figure; not measured here)
DECODE_EFFICIENCY = 0.5  # share of the memory-bandwidth roofline vLLM's decode reaches (not measured here)
INTER_NODE_BYTES_PER_S = 50e9  # one 400 Gb/s NIC per GPU
INTRA_NODE_BYTES_PER_S = 400e9  # NVLink 4, all-reduce bus bandwidth within a node
NCCL_LATENCY_S = 50e-6  # one small NCCL all-reduce (tens of microseconds in nccl-tests; not measured here)


def decode_tokens_per_s() -> float:
    """Roofline of batched decoding on one H100: each decode step reads the weights once and the batch's KV cache
    (at the mean context), at HBM bandwidth, times `DECODE_EFFICIENCY`."""
    context = PROMPT + COMPLETION / 2
    step_bytes = 2 * PARAMS_7B + DECODE_BATCH * context * KV_BYTES_PER_TOKEN_7B
    return DECODE_EFFICIENCY * DECODE_BATCH * H100_HBM_BYTES_PER_S / step_bytes


def ring_allreduce(n: int) -> tuple[float, float]:
    """(latency, seconds per byte) of a ring all-reduce of bf16 gradients over `n` GPUs: 2 (n - 1) / n of the bytes
    cross the slowest link (NVLink within a node, the NIC across two)."""
    bandwidth = INTRA_NODE_BYTES_PER_S if n <= 8 else INTER_NODE_BYTES_PER_S
    return 1e-4, 2 * (n - 1) / n / bandwidth


PROJECTION_7B = {
    "completions_per_step": 1024,  # 128 prompts x 8
    "layouts": [  # (trainer GPUs, server GPUs, one step stale); 16 GPUs in all
        (16, 0, False),
        (12, 4, False),
        (8, 8, False),
        (12, 4, True),
        (8, 8, True),
    ],
}


def projection(http_bytes_per_s: float, collectives_per_step: float) -> list[dict]:
    """The 7B layouts on 2 x 8 H100, with the push over NCCL (50 GB/s NIC-bound) and over today's HTTP
    receiver (`http_bytes_per_s`, measured on loopback here, as an upper bound); `collectives_per_step` as counted
    here, at `NCCL_LATENCY_S` each."""
    weights = 2 * PARAMS_7B
    base = Inputs(
        generated_tokens=COMPLETION,
        trained_tokens=PROMPT + COMPLETION,
        logprob_passes=1.0,  # the reference model's log-probs (beta > 0)
        generation_tokens_per_s=decode_tokens_per_s(),
        train_tokens_per_s=MFU * H100_BF16_FLOPS / (6 * PARAMS_7B),
        forward_tokens_per_s=MFU * H100_BF16_FLOPS / (2 * PARAMS_7B),
        reward_s=1e-4,
        grad_bytes=weights,
        push_bytes=weights,
        push_bytes_per_s=INTER_NODE_BYTES_PER_S,
        allreduce={n: ring_allreduce(n) for n in (8, 12, 16)},
        collectives_per_step=collectives_per_step,
        collective_latency={n: NCCL_LATENCY_S for n in (8, 12, 16)},
    )
    rows = []
    for trainers, servers, stale in PROJECTION_7B["layouts"]:
        pushes = {"nccl": INTER_NODE_BYTES_PER_S, "http": http_bytes_per_s} if servers else {"in place": 100e9}
        for push, rate in pushes.items():
            inputs = Inputs(**{**asdict(base), "push_bytes_per_s": rate})
            result = predict(inputs, PROJECTION_7B["completions_per_step"], trainers, servers, stale)
            rows.append({"trainers": trainers, "servers": servers, "stale": stale, "push": push, **result})
    return rows


def measure_http_push(megabytes: int = 256, repeats: int = 3) -> float:
    """Bytes per second through the weight receiver on loopback, the median of `repeats` uploads of `megabytes` in
    4 files (SHA-256 on both sides, and the commit)."""
    import threading

    import torch
    from safetensors.torch import save_file

    from lit_rl.rollout.server.weight_receiver import WeightReceiver, WeightUploader

    with tempfile.TemporaryDirectory(prefix="lit-rl-push-") as tmp:
        source = Path(tmp) / "source"
        source.mkdir()
        for index in range(4):
            save_file({"w": torch.zeros(megabytes * 2**20 // 16)}, str(source / f"model-{index:05d}.safetensors"))
        receiver = WeightReceiver(Path(tmp) / "received")
        threading.Thread(target=receiver.serve_forever, daemon=True).start()
        seconds = []
        try:
            uploader = WeightUploader(receiver.url, timeout_s=300, max_retries=0)
            for _ in range(repeats):
                started = time.perf_counter()
                uploader.upload(source, "current")  # the same tag: each upload replaces the last
                seconds.append(time.perf_counter() - started)
        finally:
            receiver.stop()
    return megabytes * 2**20 / statistics.median(seconds)


# -- the README's tables ----------------------------------------------------------------------------------------------
def markdown_table(results: dict) -> str:
    lines = [
        "| processes | completions/step | measured s/step | predicted s/step | error |",
        "|---|---|---|---|---|",
    ]
    for row in results["check"]:
        lines.append(
            f"| {row['devices']} | {row['completions_per_step']} | {row['measured_step_s']:.3f} "
            f"| {row['predicted_step_s']:.3f} | {row['error_pct']:+.0f}% |"
        )
    lines += [
        "",
        "| trainer GPUs | vLLM server GPUs | rollouts | push | s/step | generation | update + logprobs | all-reduce "
        "| push s | generated tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["projection"]:
        phases = row["phases_s"]
        rollouts = "colocated" if not row["servers"] else ("1 step stale" if row["stale"] else "synchronous")
        lines.append(
            f"| {row['trainers']} | {row['servers']} | {rollouts} | {row['push']} | {row['step_s']:.1f} "
            f"| {phases['generation']:.1f} | {phases['update'] + phases['logprobs']:.1f} "
            f"| {phases['allreduce']:.2f} | {phases['push']:.2f} | {row['generated_tokens_per_s']:,.0f} |"
        )
    return "\n".join(lines)


def claims(results: dict) -> list[str]:
    """The README's prose numbers: the check's worst error, and the projection's push times and decode rate."""
    errors = [abs(row["error_pct"]) for row in results["check"] if row["devices"] > 1]
    pushes = {row["push"]: row["phases_s"]["push"] for row in results["projection"]}
    return [
        f"within {max(errors):.0f}% of the measured step time",
        f"({results['http_push_bytes_per_s'] / 1e6:.0f} MB/s measured on loopback here",
        f"would take {pushes['http']:.0f} s a step",
        f"(built, not yet run on a GPU) would take {pushes['nccl']:.1f} s",
        f"{round(decode_tokens_per_s(), -2):,.0f} tokens/s per GPU",
    ]


def main() -> None:
    if sys.argv[1:2] == [COUNT_MODE]:
        fit_counting_collectives(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "grpo.yaml")
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--rounds", type=int, default=2, help="interleaved repetitions; the lower median is used (of 2: the faster)"
    )
    args = parse_report_args(parser, markdown_table, claims)
    if args.devices[0] != 1:
        parser.error("--devices must start with 1: the 1-process run gives the model its inputs")
    results = check(args)
    print("HTTP weight upload on loopback ...", flush=True)
    results["http_push_bytes_per_s"] = measure_http_push()
    results["projection"] = projection(results["http_push_bytes_per_s"], results["inputs"]["collectives_per_step"])
    publish(args, results, markdown_table, claims)


if __name__ == "__main__":
    main()
