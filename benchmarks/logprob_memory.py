"""Peak memory and time of per-token log-probs at a large vocabulary: naive full log-softmax vs lit-rl's path.

    python benchmarks/logprob_memory.py                      # vocabulary 151,936 (Qwen2), 8 x 256 tokens
    python benchmarks/logprob_memory.py --quick              # a smaller problem, for CI
    python benchmarks/logprob_memory.py --json benchmarks/results/logprob_memory_cpu.json
    python benchmarks/logprob_memory.py --markdown benchmarks/results/logprob_memory_cpu.json   # the README's table

Each method runs in a fresh subprocess that first builds the logits (bf16, as a bf16 model returns them) and
then computes the log-probs of given tokens; the reported peak is the growth of the process's peak RSS during the
computation only (peak RSS after minus RSS before, Linux), so the shared input does not count. Values are
compared (max |difference|) in the parent.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from provenance import add_allow_dirty, check_output, write_report  # noqa: E402

from lit_rl.numerics import settle_cpu_math_kernels  # noqa: E402

settle_cpu_math_kernels()  # as every lit-rl process does, before any threaded float math (lit_rl/numerics.py)

METHODS = ("naive", "lit_rl")
LABELS = {
    "naive": "naive `log_softmax(logits.float()).gather(...)`",
    "lit_rl": "lit-rl `token_logprobs` (64 MiB fp32 chunks of `logit[id] - logsumexp`)",
}


def _logits(batch: int, length: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random bf16 logits, filled 16 rows at a time so that building them does not raise the peak RSS."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.empty(batch * length, vocab, dtype=torch.bfloat16)
    for start in range(0, batch * length, 16):
        rows = min(16, batch * length - start)
        logits[start : start + rows] = torch.randn(rows, vocab, generator=generator).to(torch.bfloat16)
    ids = torch.randint(0, vocab, (batch, length), generator=generator)
    return logits.view(batch, length, vocab), ids


def _rss_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def _compute(method: str, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    if method == "naive":
        return torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[..., None]).squeeze(-1)
    from lit_rl.ops import token_logprobs

    return token_logprobs(logits, ids)


def _child(method: str, batch: int, length: int, vocab: int, out: str) -> None:
    logits, ids = _logits(batch, length, vocab)
    before = _rss_kib()  # the peak below is compared with what the process holds now (logits included)
    start = time.perf_counter()
    values = _compute(method, logits, ids)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    torch.save({"values": values, "seconds": seconds, "peak_mib": (after - before) / 1024}, out)


def run(batch: int, length: int, vocab: int, workdir: Path) -> dict:
    results = {}
    for method in METHODS:
        out = workdir / f"{method}.pt"
        subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                method,
                "--batch",
                str(batch),
                "--length",
                str(length),
                "--vocab",
                str(vocab),
                "--out",
                str(out),
            ],
            check=True,
        )
        results[method] = torch.load(out, weights_only=True)
    diff = (results["naive"]["values"] - results["lit_rl"]["values"]).abs().max().item()
    return {
        "batch": batch,
        "length": length,
        "vocab": vocab,
        "logits_mib": batch * length * vocab * 2 / 2**20,
        "naive": {"seconds": results["naive"]["seconds"], "peak_mib": results["naive"]["peak_mib"]},
        "lit_rl": {"seconds": results["lit_rl"]["seconds"], "peak_mib": results["lit_rl"]["peak_mib"]},
        "peak_memory_ratio": results["lit_rl"]["peak_mib"] / max(results["naive"]["peak_mib"], 1e-9),
        "time_ratio": results["lit_rl"]["seconds"] / results["naive"]["seconds"],
        "max_abs_diff": diff,
    }


def markdown_table(results: dict) -> str:
    """The README's table of a results file (a test checks the README carries exactly this)."""
    lines = ["| path | peak extra memory | seconds |", "|---|---|---|"]
    for method in METHODS:
        lines.append(f"| {LABELS[method]} | {results[method]['peak_mib']:.0f} MiB | {results[method]['seconds']:.2f} |")
    return "\n".join(lines)


def claims(results: dict) -> list[str]:
    """The README's prose numbers of a results file (a test checks the README says them)."""
    return [
        f"bf16 logits for {results['batch']} x {results['length']} tokens at vocabulary {results['vocab']:,} = "
        f"{results['logits_mib']:.0f} MiB",
        f"Memory ratio {results['peak_memory_ratio']:.3f}, time ratio {results['time_ratio']:.2f}, max |difference| "
        f"{results['max_abs_diff']:.1e}.".replace("e-0", "e-"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--quick", action="store_true", help="8 x 128 tokens at vocabulary 151,936")
    parser.add_argument("--json", type=Path, default=None, help="JSON results (machine, versions, commit, command)")
    parser.add_argument("--markdown", type=Path, default=None, help="print the markdown table of a results JSON")
    add_allow_dirty(parser)
    parser.add_argument("--child", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return _child(args.child, args.batch, args.length, args.vocab, args.out)
    if args.markdown:
        print(markdown_table(json.loads(args.markdown.read_text())["results"]))
        return
    check_output(args.json, args.allow_dirty)
    if args.quick:
        args.batch, args.length = 8, 128
    import tempfile

    from rich.console import Console
    from rich.table import Table

    with tempfile.TemporaryDirectory() as workdir:
        report = run(args.batch, args.length, args.vocab, Path(workdir))
    table = Table(
        title=f"per-token log-probs, {args.batch} x {args.length} tokens, vocabulary {args.vocab:,} "
        f"(bf16 logits: {report['logits_mib']:.0f} MiB)"
    )
    for column in ("method", "peak extra memory (MiB)", "seconds"):
        table.add_column(column, justify="right")
    for method in METHODS:
        table.add_row(method, f"{report[method]['peak_mib']:.1f}", f"{report[method]['seconds']:.3f}")
    Console(width=120).print(table)
    print(
        f"peak memory ratio lit_rl/naive: {report['peak_memory_ratio']:.3f}; time ratio: {report['time_ratio']:.2f};"
        f" max |difference|: {report['max_abs_diff']:.2e}"
    )
    if args.json:
        write_report(args.json, report, allow_dirty=args.allow_dirty)


if __name__ == "__main__":
    main()
