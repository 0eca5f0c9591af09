"""Peak memory of lit-rl and TRL on long completions at a large vocabulary (issue 18: "long completions fit").

    python benchmarks/long_completions.py --out benchmarks/results/long_completions_cpu.json
    python benchmarks/long_completions.py --quick        # vocabulary 8,192, completions of 16-48 tokens, 2 steps
    python benchmarks/long_completions.py --markdown benchmarks/results/long_completions_cpu.json

The workload, the same for both libraries (`compare_trl.lit_run` / `compare_trl.trl_run`, one process per run):
GRPO with 2 prompts x 4 completions per optimizer step (one micro-batch of 8), completions of 256 to 1024 tokens,
sampled with the HF engine / `generate` from a randomly initialised Qwen2 of hidden 128, 4 layers and Qwen2's
vocabulary of 151,936 (tied embeddings: 20.3M parameters), with a tokenizer of as many tokens. Its near-uniform
next-token probabilities and 500 stop ids besides EOS end a completion at random, about 300 tokens after the
first 256, where no stop may come (lit-rl `model.sampling.min_new_tokens`, TRL `generation_kwargs.min_new_tokens`).
Reward: the decoded text's length. fp32, no gradient checkpointing, beta 0, temperature 1, AdamW, CPU.

Runs: lit-rl padding-free with the head in chunks of `--head-chunk` tokens (`model.policy.head_chunk_tokens`, the
long-completion setting); lit-rl padding-free with whole logits (what the chunks save); TRL with its fp32 path.
Each reports the process's peak RSS (`ru_maxrss` at the end: the model, the optimizer, generation and the
training step together), its seconds per step (median after the first), and the completion lengths it trained
on (lit-rl: the engine's masks; TRL: its logged min and max lengths).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from compare_trl import Workload, lit_run, trl_run  # noqa: E402
from provenance import parse_report_args, write_report  # noqa: E402

STOP_IDS = 500  # besides EOS


def text_length(prompts, completions, **columns) -> list[float]:
    """The decoded completion's length in thousands of characters: varies within a group, never saturates."""
    return [len(text) / 1000 for text in completions]


def build_long_model(out_dir: Path, vocab: int, max_positions: int, stop_ids: int) -> str:
    """A random Qwen2 of hidden 128, 4 layers, `vocab` entries, with a tokenizer of `vocab` tokens (the 256 bytes,
    EOS, pad, then distinct 2- and 3-letter strings, so that any sampled id decodes to text) whose generation
    config counts `stop_ids` ids besides EOS as stops."""
    import itertools
    import string

    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM

    from lit_rl.modeling.models import SPECIAL_TOKENS, build_char_tokenizer, tiny_qwen2_config

    letters = string.ascii_letters + string.digits
    words = ("".join(chars) for n in (2, 3) for chars in itertools.product(letters, repeat=n))
    extra = vocab - 256 - len(SPECIAL_TOKENS)  # after the bytes and the special tokens
    tokenizer = build_char_tokenizer(itertools.islice(words, extra), model_max_length=max_positions)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(tiny_qwen2_config(vocab_size=vocab, max_position_embeddings=max_positions))
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    stops = list(range(1000, 1000 + stop_ids))  # ordinary words, far from the bytes the prompts use
    config = GenerationConfig(eos_token_id=[tokenizer.eos_token_id, *stops], pad_token_id=tokenizer.pad_token_id)
    config.save_pretrained(out_dir)
    return str(out_dir)


def run_child(library: str, model: str, steps: int, workdir: Path, work: Workload) -> dict:
    out = workdir / "run.json"
    command = [sys.executable, __file__, "--child", library, model, str(steps), str(out), json.dumps(asdict(work))]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{library} failed:\n{result.stderr[-3000:]}")
    return json.loads(out.read_text())


def child(library: str, model: str, steps: int, out: Path, work: Workload) -> None:
    """One run; writes its step times, peak RSS and completion lengths to `out`."""
    lengths: list[int] = []
    if library == "trl":
        from compare_trl import TRL_LOG_HISTORY

        times = trl_run("grpo", model, steps, out.parent, work)
        for row in TRL_LOG_HISTORY:
            if "completions/min_length" in row:
                lengths += [int(row["completions/min_length"]), int(row["completions/max_length"])]
    else:
        import lit_rl.training.metrics as metrics

        update = metrics.update_rollout_metrics

        def recording(m, reward_fns, rewards, components, completion_mask, *rest):
            lengths.extend(completion_mask.sum(dim=1).long().tolist())
            return update(m, reward_fns, rewards, components, completion_mask, *rest)

        metrics.update_rollout_metrics = recording
        import lit_rl.algorithms.on_policy as on_policy

        on_policy.update_rollout_metrics = recording
        times = lit_run("grpo", model, steps, out.parent, work)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    out.write_text(json.dumps({"times": times, "peak_rss_mib": peak_mib, "lengths": lengths}))


def markdown_table(results: list[dict]) -> str:
    """The README's table of a results file (a test checks the README carries exactly this)."""
    lines = [
        "| run | peak RSS (GiB) | s/step | completion tokens (min-max) |",
        "|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['run']} | {r['peak_rss_mib'] / 1024:.2f} | {r['s_per_step']:.1f} | "
            f"{r['min_length']}-{r['max_length']} |"
        )
    return "\n".join(lines)


def claims(results: list[dict]) -> list[str]:
    """The README's prose numbers of a results file (a test checks the README says them)."""
    by_run = {r["run"]: r for r in results}
    chunked, whole, trl = (by_run[name] for name in RUNS)
    return [
        f"lit-rl's peak RSS is {chunked['peak_rss_mib'] / trl['peak_rss_mib']:.2f}x TRL's",
        f"its step {chunked['s_per_step'] / trl['s_per_step']:.2f}x TRL's time",
        f"{whole['peak_rss_mib'] / chunked['peak_rss_mib']:.1f}x less than with whole logits",
    ]


RUNS = ("lit-rl, head chunks", "lit-rl, whole logits", "TRL")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        library, model, steps, out, work = sys.argv[2:7]
        child(library, model, int(steps), Path(out), Workload(**json.loads(work)))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--head-chunk", type=int, default=256, help="lit-rl's model.policy.head_chunk_tokens")
    parser.add_argument("--quick", action="store_true", help="vocabulary 8,192, completions of 16-48, 2 steps")
    args = parse_report_args(parser, markdown_table, claims)
    vocab, min_tokens, max_tokens = (8192, 16, 48) if args.quick else (151936, 256, 1024)
    steps = 2 if args.quick else args.steps
    results = []
    with tempfile.TemporaryDirectory(prefix="lit-rl-long-") as tmp:
        model = build_long_model(Path(tmp) / "model", vocab, max_tokens + 64, STOP_IDS if not args.quick else 100)
        base = dict(group=4, prompts=2, max_new_tokens=max_tokens, min_new_tokens=min_tokens)
        base["reward"] = "long_completions.text_length"
        packed = ("--model.policy.padding_free", "true")
        chunks = (*packed, "--model.policy.head_chunk_tokens", str(args.head_chunk))
        works = {
            RUNS[0]: ("lit_rl", Workload(**base, lit_flags=chunks)),
            RUNS[1]: ("lit_rl", Workload(**base, lit_flags=packed)),
            RUNS[2]: ("trl", Workload(**base)),
        }
        for name, (library, work) in works.items():
            workdir = Path(tmp) / name.replace(" ", "_").replace(",", "")
            workdir.mkdir()
            run = run_child(library, model, steps, workdir, work)
            times = run["times"][1:] or run["times"]
            result = {
                "run": name,
                "peak_rss_mib": run["peak_rss_mib"],
                "s_per_step": statistics.median(times),
                "min_length": min(run["lengths"]),
                "max_length": max(run["lengths"]),
                "step_times": run["times"],
            }
            print(f"  {name}: {result['peak_rss_mib'] / 1024:.2f} GiB, {result['s_per_step']:.1f} s/step", flush=True)
            results.append(result)
    print(markdown_table(results))
    if args.out:
        import trl

        settings = {"vocab": vocab, "min_new_tokens": min_tokens, "max_new_tokens": max_tokens, "steps": steps}
        write_report(args.out, results, versions={"trl": trl.__version__}, allow_dirty=args.allow_dirty, **settings)


if __name__ == "__main__":
    main()
