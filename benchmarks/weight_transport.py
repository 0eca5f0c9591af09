"""How fast the weights travel to a vLLM server that does not share the trainer's disk, on loopback: the HTTP
weight receiver (`model.rollout.engine.transfer.method: http`) against the gloo broadcast (`weight_transfer: gloo`).

    python benchmarks/weight_transport.py --out benchmarks/results/weight_transport_cpu.json   # about 1 min

The same bytes (`--megabytes`, in `--tensors` float32 tensors) go each way, in interleaved rounds, so the machine's
load hits both alike:

- **http**: `WeightUploader.upload` of the tensors as safetensors files (written first, untimed) to a
  `WeightReceiver` in this process: SHA-256 on both sides, up to 4 files at once, the commit.
- **gloo**: `lit_rl.rollout.server.collective_transfer.GlooGroup` as rank 0 broadcasting each tensor to a child process
  that joins the group as a vLLM worker does (`vllm.distributed.utils.stateless_init_torch_distributed_process_group`,
  what `lit_rl.rollout.in_server.vllm_transfer_plugin` runs) and receives into fresh tensors. The round ends when the
  child says it has them all.

Neither includes vLLM loading the weights (the same for both). Reports MB/s per round, the medians, and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from provenance import parse_report_args, publish  # noqa: E402


def receive(port: int, tensors: int, numel: int, rounds: int) -> None:
    """The child: join as rank 1, receive `rounds` x `tensors` broadcasts, print one line per round."""
    import torch
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    group = stateless_init_torch_distributed_process_group(
        "127.0.0.1", port, 1, 2, "gloo", timeout=timedelta(seconds=300)
    )
    options = torch.distributed.BroadcastOptions()
    options.rootRank = 0
    for _ in range(rounds):
        for _ in range(tensors):
            tensor = torch.empty(numel)
            group.broadcast([tensor], options).wait()
        print("received", flush=True)


def measure(megabytes: int, tensors: int, rounds: int) -> dict:
    import torch
    from safetensors.torch import save_file

    from lit_rl.rollout.server.collective_transfer import GlooGroup, listen
    from lit_rl.rollout.server.weight_receiver import WeightReceiver, WeightUploader

    numel = megabytes * 2**20 // 4 // tensors
    weights = [torch.randn(numel) for _ in range(tensors)]
    nbytes = sum(w.numel() * 4 for w in weights)
    listener = listen("127.0.0.1", 0)
    port = listener.getsockname()[1]
    child = subprocess.Popen(
        [sys.executable, __file__, "--receive", str(port), str(tensors), str(numel), str(rounds)],
        stdout=subprocess.PIPE,
        text=True,
    )
    seconds: dict[str, list[float]] = {"http": [], "gloo": []}
    with tempfile.TemporaryDirectory(prefix="lit-rl-transport-") as tmp:
        source = Path(tmp) / "source"
        source.mkdir()
        per_file = max(1, tensors // 4)
        for index in range(0, tensors, per_file):
            chunk = {f"w{i}": weights[i] for i in range(index, min(tensors, index + per_file))}
            save_file(chunk, str(source / f"model-{index // per_file:05d}.safetensors"))
        receiver = WeightReceiver(Path(tmp) / "received")
        threading.Thread(target=receiver.serve_forever, daemon=True).start()
        try:
            group = GlooGroup(listener, "127.0.0.1", 2, timeout_s=300)
            listener.close()
            uploader = WeightUploader(receiver.url, timeout_s=300, max_retries=0)
            for _ in range(rounds):
                started = time.perf_counter()
                uploader.upload(source, "current")
                seconds["http"].append(time.perf_counter() - started)
                started = time.perf_counter()
                for tensor in weights:
                    group.broadcast(tensor, give_up=lambda: False)
                assert child.stdout.readline().strip() == "received"
                seconds["gloo"].append(time.perf_counter() - started)
        finally:
            receiver.stop()
            child.wait(timeout=60)
    rates = {way: [nbytes / s / 1e6 for s in values] for way, values in seconds.items()}
    medians = {way: statistics.median(values) for way, values in rates.items()}
    return {
        "megabytes": nbytes / 1e6,
        "tensors": tensors,
        "rounds": rounds,
        "mb_per_s": rates,
        "median_mb_per_s": medians,
        "gloo_over_http": medians["gloo"] / medians["http"],
    }


def markdown_table(results: dict) -> str:
    """The README's table of a results file (a test checks the README carries exactly this)."""
    lines = ["| way | MB/s per round | median MB/s |", "|---|---|---|"]
    for way, label in (("http", "HTTP receiver (SHA-256, commit)"), ("gloo", "gloo broadcast")):
        rounds = ", ".join(f"{rate:.0f}" for rate in results["mb_per_s"][way])
        lines.append(f"| {label} | {rounds} | {results['median_mb_per_s'][way]:.0f} |")
    return "\n".join(lines)


def claims(results: dict) -> list[str]:
    return [
        f"{results['megabytes']:.0f} MB in {results['tensors']} tensors, {results['rounds']} interleaved rounds: "
        f"the gloo broadcast moved the weights {results['gloo_over_http']:.1f}x as fast as the HTTP receiver"
    ]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--receive":
        receive(*(int(arg) for arg in sys.argv[2:6]))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megabytes", type=int, default=256)
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    args = parse_report_args(parser, markdown_table, claims)
    results = measure(args.megabytes, args.tensors, args.rounds)
    publish(args, results, markdown_table, claims)


if __name__ == "__main__":
    main()
