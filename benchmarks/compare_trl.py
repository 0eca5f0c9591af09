"""Seconds per optimizer step of lit-rl and TRL on the same workload, from interleaved runs.

    python benchmarks/compare_trl.py --out benchmarks/results/compare_trl_cpu.json   # tiny and ~20M, GRPO and DPO
    python benchmarks/compare_trl.py --quick                                          # tiny model, 6 steps each
    python benchmarks/compare_trl.py --markdown benchmarks/results/compare_trl_cpu.json

Needs TRL (`pip install trl`; not a lit-rl dependency). Each run is its own process; runs alternate lit-rl, TRL,
lit-rl, TRL, ... (`--rounds`), so a slow spell of a shared machine hits both. Seconds per step: the median of the
wall time between consecutive optimizer steps after `--warmup` steps (lit-rl's `perf/step_s`; for TRL the time
between `on_step_end` callbacks), then the median over rounds.

The workloads, the same for both libraries:
- GRPO: the built-in addition prompts, 8 prompts x G = 8 completions per step (one micro-batch of 64), at most
  8 new tokens, temperature 1, beta 0 (no reference model), one iteration, the GRPO paper's sequence-level loss
  (lit-rl `loss_aggregation: sequence`, TRL `loss_type: grpo`), group-std advantages, reward = correctness,
  HF `generate` (TRL `use_vllm: false`), AdamW lr 1e-5, fp32, CPU.
- DPO: the built-in addition preference pairs, 32 pairs per step, sigmoid loss, beta 0.1, a live reference
  model, AdamW lr 1e-5, fp32, CPU.
Both without gradient checkpointing, gradient norm clipped at 1 (TRL's default `max_grad_norm`, lit-rl's configs).
Models: the shipped tiny model (1M parameters) and a randomly initialised Qwen2 of hidden 512, 8 layers (21M),
both with the character tokenizer.

`--workloads variable` (issue 18: completions of very different lengths):
- GRPO samples up to 128 new tokens from a randomly initialised model (tiny: hidden 128, 4 layers; 20m as above)
  whose generation config counts 5 ids besides EOS as stops; near-uniform next-token probabilities make a
  completion stop at random, 1 to 128 tokens (mean about 50-60). The reward is `length_reward`.
- DPO trains on `variable_pairs`: the addition prompts with random answers of 32-128 characters (tokens).
- lit-rl runs padding-free (`--model.policy.padding_free true`); its HF engine skips finished rows by default.
`--settings matched` runs both in fp32 without gradient checkpointing; `--settings defaults` runs each library
with its documented defaults (TRL: bf16 mixed precision and gradient checkpointing; lit-rl: fp32, none).

    python benchmarks/compare_trl.py --workloads variable --settings matched defaults --steps 10 --warmup 3 \
        --rounds 1 --out benchmarks/results/compare_trl_variable_cpu.json

`--workloads fixed32` (issue 34): GRPO with 2 prompts x G = 8 completions of exactly 32 tokens per step (no stop
before the budget: lit-rl `min_new_tokens`, TRL `generation_kwargs`), and DPO as above, on the 20m model. Settings:
- `matched`: both in fp32; `bf16`: lit-rl `bf16-mixed` (`configs/precision/bf16.yaml`), TRL `bf16=True` (autocast);
- `fastest`: each library at its fastest documented setting on this CPU. lit-rl: `bf16-true`, compiled decoding
  (`configs/rollout/hf_compiled.yaml`), DPO with its reference log-probs precomputed. TRL: the model loaded in
  bfloat16 with `bf16=True` (TRL has no compiled decoding on CPU: `generate` compiles only on GPUs), DPO with
  `precompute_ref_log_probs`. Both with eager attention (lit-rl `model.policy.attn_implementation: eager`, TRL
  the model loaded so), which trains short bf16 sequences faster than sdpa's CPU flash kernel.
- `compiled`: `fastest`, and each library's training model compiled too: lit-rl `model.policy.compile`, TRL the
  Trainer's `torch_compile=True` (accelerate compiles the model it trains; TRL's GRPO still generates eager).
Each cell also reports MFU: the step's model FLOPs (lit-rl's count, `perf/tflops` x `perf/step_s`; the same math
for TRL, which runs the same workload) over the matmul peak of the compute dtype, measured once at the start of the
script for 1 s and the same for every cell (`matmul_peaks`),
and where each library's step goes: lit-rl's the median of each `perf/` phase timer (as for the variable-length
workloads), TRL's GRPO the median time of its `generate` calls (`time_generation`) and the rest of its step.

    python benchmarks/compare_trl.py --workloads fixed32 --models 20m --settings matched bf16 fastest compiled \
        --steps 12 --warmup 5 --rounds 3 --out benchmarks/results/compare_trl_fixed32_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from provenance import parse_report_args, write_report  # noqa: E402
from support import build_random_model  # noqa: E402
from throughput import fit_flags, metric_rows  # noqa: E402

from lit_rl.modeling.models import resolve_model_path  # noqa: E402

TINY = "lit-rl/tiny-qwen2-addition-sft"
TRL_LOG_HISTORY: list[dict] = []  # the last `trl_run`'s `trainer.state.log_history`
TRL_GENERATION_S: list[float] = []  # the last GRPO `trl_run`'s seconds in `generate`, one call per optimizer step
LIT_PHASES: list[dict] = []  # the last `lit_run`'s per-step phase times (`PHASES`), and `perf/step_s`, `perf/tflops`
# Where a lit-rl step goes (its `perf/` timers): the profile reported beside the variable-length ratios.
PHASES = ("generation_s", "reward_s", "old_logprobs_s", "ref_logprobs_s", "policy_update_s")
RATES = ("step_s", "tflops")  # also kept per lit-rl step: its FLOPs (tflops x step_s) make the MFU columns


@dataclass
class Workload:
    """What both libraries run. The defaults are this script's CPU workloads; `benchmarks/gpu_suite.py` runs GRPO
    on a GPU in bf16 with colocated vLLM through the same two functions."""

    group: int = 8  # G, completions per prompt
    prompts: int = 8  # prompts per optimizer step
    max_new_tokens: int = 8
    pairs: int = 32  # DPO pairs per step
    learning_rate: float = 1e-5
    gpu: bool = False
    bf16: bool = False  # lit-rl `bf16-mixed`, TRL `bf16=True`
    vllm: bool = False  # colocated vLLM (lit-rl `configs/rollout/vllm_colocate.yaml`, TRL `vllm_mode="colocate"`)
    sleep_mode: bool = False
    gpu_memory_utilization: float = 0.3
    # Variable lengths (issue 18): GRPO samples up to `max_new_tokens` from a random model that stops at random
    # (`stop_tokens` ids end a completion), rewarded by `length_reward`; DPO trains on random pairs of 32-128
    # tokens (`variable_pairs`). lit-rl runs padding-free (`model.policy.padding_free`).
    variable: bool = False
    stop_tokens: int = 5
    # Each library with its documented defaults (TRL: bf16 and gradient checkpointing on; lit-rl: fp32, none)
    # instead of both in fp32 without gradient checkpointing.
    library_defaults: bool = False
    # Each library at its fastest documented setting on the device (`--settings fastest`: the module docstring),
    # and lit-rl's policy compiled on top (`--settings compiled`).
    fastest: bool = False
    compiled_policy: bool = False
    # Long completions (`benchmarks/long_completions.py`): no stop before `min_new_tokens` (lit-rl
    # `model.sampling.min_new_tokens`, TRL `generation_kwargs`), the reward's import path, and lit-rl flags on top.
    min_new_tokens: int = 0
    reward: str = ""
    lit_flags: tuple[str, ...] = ()
    # TRL's `cache_implementation` for HF `generate` ("static": compiled decoding on a GPU); empty: its default.
    trl_cache_implementation: str = ""
    # Both libraries' attention kernel (lit-rl `model.policy.attn_implementation`, TRL the model it is given);
    # empty: the model's default (sdpa).
    attn_implementation: str = ""


# -- one run (a child process) ---------------------------------------------------------------------------------
def lit_run(algorithm: str, model: str, steps: int, workdir: Path, work: Workload = Workload()) -> list[float]:
    """lit-rl's CLI on the workload; its per-step wall times (`perf/step_s`)."""
    from lit_rl.cli import main

    common = [
        "--model.policy.model_name_or_path",
        model,
        "--model.optim.learning_rate",
        str(work.learning_rate),
        "--trainer.limit_val_batches",
        "0",
        *fit_flags(steps, workdir),
    ]
    if work.gpu:
        common += ["--trainer.accelerator", "gpu", "--trainer.devices", "1"]
    if work.bf16:
        common += ["--trainer.precision", "bf16-mixed"]
    if work.fastest:
        common += ["--trainer.precision", "bf16-true"]
    if work.compiled_policy:
        common += ["--model.policy.compile", "true"]
    if work.attn_implementation:
        common += ["--model.policy.attn_implementation", work.attn_implementation]
    if work.variable:
        common += ["--model.policy.padding_free", "true"]
    if algorithm == "grpo":
        reward = "compare_trl.length_reward" if work.variable else "lit_rl.rewards.arithmetic.correctness"
        reward = work.reward or reward
        args = [
            "--config",
            str(REPO / "configs" / "grpo.yaml"),
            "--model.rewards.funcs",
            f"[{reward}]",
            "--model.rewards.weights",
            "null",
            "--model.sampling.num_generations",
            str(work.group),
            "--model.schedule.micro_batch_size",
            str(work.group * work.prompts),
            "--model.sampling.max_new_tokens",
            str(work.max_new_tokens),
            "--model.loss.beta",
            "0.0",
            "--model.loss.aggregation",
            "sequence",
            "--model.sampling.min_new_tokens",
            str(work.min_new_tokens),
        ]
        if work.fastest:
            args += ["--config", str(REPO / "configs" / "rollout" / "hf_compiled.yaml")]
        if work.vllm:
            args += ["--config", str(REPO / "configs" / "rollout" / "vllm_colocate.yaml")]
            args += ["--model.rollout.engine.enable_sleep_mode", str(work.sleep_mode).lower()]
            args += ["--model.rollout.engine.gpu_memory_utilization", str(work.gpu_memory_utilization)]
    else:
        args = ["--config", str(REPO / "configs" / "dpo.yaml"), "--data.batch_size", str(work.pairs)]
        if work.fastest:
            args += ["--model.precompute_ref_logprobs", "true", "--model.ref_cache_dir", str(workdir / "ref")]
        if work.variable:
            pairs = workdir / "pairs.jsonl"
            pairs.write_text("".join(json.dumps(row) + "\n" for row in variable_pairs()))
            args += ["--data.train_data", str(pairs), "--data.val_data", "null"]
    main(["fit", *args, *common, *work.lit_flags])
    (log_dir,) = workdir.glob("*/version_*")
    rows = [row for row in metric_rows(log_dir) if "perf/step_s" in row]
    LIT_PHASES[:] = [{key: row.get(f"perf/{key}", 0.0) for key in (*PHASES, *RATES)} for row in rows]
    return [row["perf/step_s"] for row in rows]


def trl_run(algorithm: str, model: str, steps: int, workdir: Path, work: Workload = Workload()) -> list[float]:
    """TRL's trainer on the workload; the wall times between its optimizer steps."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback

    from lit_rl.data.arithmetic import addition_preference_rows, addition_rows
    from lit_rl.modeling.models import load_causal_lm, load_tokenizer
    from lit_rl.rewards.arithmetic import correctness

    torch.manual_seed(0)
    marks: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if not marks:
                marks.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            marks.append(time.perf_counter())

    tokenizer = load_tokenizer(model)
    dtype = "bfloat16" if work.fastest else "float32"  # TRL's `model_init_kwargs` dtype, for a model we load
    attention = work.attn_implementation or None
    policy = load_causal_lm(model, dtype=dtype, attn_implementation=attention, disable_dropout=True)
    common = dict(
        output_dir=str(workdir),
        max_steps=steps,
        learning_rate=work.learning_rate,
        lr_scheduler_type="constant",
        use_cpu=not work.gpu,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    if not work.library_defaults:
        # TRL's configs default to bf16 mixed precision and gradient checkpointing; the workload says which
        # precision, and both run without checkpointing.
        common.update(bf16=work.bf16 or work.fastest, gradient_checkpointing=False)
    if work.compiled_policy:
        # The Trainer's documented `torch_compile`: accelerate compiles the model it trains (inductor), as lit-rl's
        # `model.policy.compile` does; TRL's GRPO still generates eager (`generate` is the underlying model's method,
        # which runs its uncompiled forward).
        common["torch_compile"] = True
    if algorithm == "grpo":
        from trl import GRPOConfig, GRPOTrainer

        rows = addition_rows("train")
        dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
        reward = length_reward if work.variable else correctness
        if work.reward:
            from lit_rl.importing import import_callable

            reward = import_callable(work.reward, "reward")
        config = GRPOConfig(
            **common,
            per_device_train_batch_size=work.group * work.prompts,
            gradient_accumulation_steps=1,
            num_generations=work.group,
            max_completion_length=work.max_new_tokens,
            temperature=1.0,
            top_k=0,
            beta=0.0,
            num_iterations=1,
            loss_type="grpo",
            scale_rewards="group",
            disable_dropout=True,
            use_vllm=work.vllm,
            vllm_mode="colocate",
            vllm_enable_sleep_mode=work.sleep_mode,
            vllm_gpu_memory_utilization=work.gpu_memory_utilization,
            generation_kwargs={"min_new_tokens": work.min_new_tokens} if work.min_new_tokens else None,
            cache_implementation=work.trl_cache_implementation or None,
        )
        time_generation(policy)
        trainer = GRPOTrainer(
            model=policy,
            reward_funcs=[reward],
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[StepTimes()],
        )
    else:
        from trl import DPOConfig, DPOTrainer

        rows = variable_pairs() if work.variable else addition_preference_rows("train")
        dataset = Dataset.from_list([{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in rows])
        config = DPOConfig(
            **common,
            per_device_train_batch_size=work.pairs,
            beta=0.1,
            loss_type="sigmoid",
            precompute_ref_log_probs=work.fastest,
        )
        ref = None if work.fastest else load_causal_lm(model, attn_implementation=attention, disable_dropout=True)
        trainer = DPOTrainer(
            model=policy,
            ref_model=ref,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[StepTimes()],
        )
    trainer.train()
    TRL_LOG_HISTORY[:] = trainer.state.log_history  # for callers that read more than the step times
    return [b - a for a, b in zip(marks, marks[1:])]


def time_generation(policy) -> None:
    """Record the seconds of each of `policy.generate`'s calls in `TRL_GENERATION_S`: TRL's GRPO samples through
    the model's own `generate` (eager, also when the Trainer compiles the model it trains), once per optimizer step
    here, so TRL's step splits into generation and the rest as lit-rl's `perf/` timers split its own."""
    generate = policy.generate
    TRL_GENERATION_S.clear()

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return generate(*args, **kwargs)
        finally:
            TRL_GENERATION_S.append(time.perf_counter() - start)

    policy.generate = timed


# -- the variable-length workloads -------------------------------------------------------------------------------
def length_reward(prompts, completions, **columns) -> list[float]:
    """Longer is better, up to 128 characters: a reward that varies within a group on any model."""
    return [min(len(text), 128) / 128 for text in completions]


def variable_pairs(count: int = 2048, seed: int = 0) -> list[dict[str, str]]:
    """Preference pairs with the built-in addition prompts and random answers of 32-128 characters (one token each
    with the character tokenizer), chosen and rejected of independent lengths."""
    import random

    from lit_rl.data.arithmetic import addition_rows

    rng = random.Random(seed)
    prompts = [row["prompt"] for row in addition_rows("train")]
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789 "

    def text() -> str:
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(32, 128)))

    return [{"prompt": prompts[i % len(prompts)], "chosen": text(), "rejected": text()} for i in range(count)]


def build_stopping_model(out_dir: Path, stop_tokens: int, **sizes) -> str:
    """A random Qwen2 (the character tokenizer) whose generation config ends a completion on `stop_tokens` ids
    besides EOS: random weights give nearly uniform next-token probabilities, so completions stop at random,
    after about vocab / stop_tokens tokens on average. Both libraries read the generation config's EOS ids."""
    from transformers import GenerationConfig

    path = build_random_model(out_dir, max_position_embeddings=256, **sizes)
    config = GenerationConfig.from_pretrained(path) if (path / "generation_config.json").exists() else None
    config = config or GenerationConfig()
    from lit_rl.modeling.models import load_tokenizer

    tokenizer = load_tokenizer(str(path))
    special = set(tokenizer.all_special_ids)
    stops = [i for i in range(len(tokenizer)) if i not in special][10 : 10 + stop_tokens]
    config.eos_token_id = [tokenizer.eos_token_id, *stops]
    config.save_pretrained(path)
    return str(path)


# -- the comparison ----------------------------------------------------------------------------------------------
def run_child(
    library: str, algorithm: str, model: str, steps: int, workdir: Path, work: Workload = Workload()
) -> list[float]:
    """One run in a process of its own: the per-step wall times of `library` on the workload."""
    out = workdir / "times.json"
    command = [sys.executable, __file__, "--child", library, algorithm, model, str(steps), str(out)]
    command.append(json.dumps(asdict(work)))
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{library} {algorithm} on {model} failed:\n{result.stderr[-3000:]}")
    return json.loads(out.read_text())


def compare(
    algorithm: str,
    model_name: str,
    model: str,
    args,
    tmp: Path,
    work: Workload = Workload(),
    workload: str = "fixed",
    setting: str = "matched",
    peak_tflops: Optional[float] = None,
) -> dict:
    """The cell's s/step of both libraries over `args.rounds` interleaved rounds; with `peak_tflops` (the compute
    dtype's matmul peak, `matmul_peaks`), both libraries' MFU on lit-rl's FLOP count."""
    per_round: dict[str, list[float]] = {"lit_rl": [], "trl": []}
    steps: list[dict] = []  # lit-rl's per-step phase times and rates after the warm-up, over rounds
    trl_generation: list[float] = []  # TRL's seconds in `generate` per step after the warm-up (GRPO), over rounds
    label = f"{workload}-{setting}"
    for round_index in range(args.rounds):
        for library in ("lit_rl", "trl"):
            workdir = tmp / f"{algorithm}-{model_name}-{label}-{library}-{round_index}"
            workdir.mkdir()
            times = run_child(library, algorithm, model, args.steps, workdir, work)
            if len(times) <= args.warmup:
                raise RuntimeError(f"{library}: {len(times)} step times, not more than --warmup {args.warmup}")
            per_round[library].append(statistics.median(times[args.warmup :]))
            phases = workdir / "phases.json"
            if library == "lit_rl":
                steps += json.loads(phases.read_text())[args.warmup :]
            elif phases.exists():
                trl_generation += [step["generation_s"] for step in json.loads(phases.read_text())[args.warmup :]]
            print(
                f"  {algorithm} {model_name} {label} {library} round {round_index}: {per_round[library][-1]:.3f} s/step"
            )
    lit, trl = (statistics.median(per_round[name]) for name in ("lit_rl", "trl"))
    ratio = paired_ratio(per_round)
    variant = {} if label == "fixed-matched" else {"workload": workload, "setting": setting}
    if work.variable or workload == "fixed32":  # where lit-rl's step goes: the median of each phase
        variant["lit_rl_phases_s"] = {phase: statistics.median(step[phase] for step in steps) for phase in PHASES}
        if trl_generation:  # TRL's own generation, timed around its `generate` calls (`time_generation`)
            variant["trl_generation_s"] = statistics.median(trl_generation)
    if peak_tflops is not None:  # both libraries' model-FLOP utilisation (the module docstring)
        flops = statistics.median(step["tflops"] * step["step_s"] for step in steps)  # TFLOP per step
        variant |= {"tflop_per_step": flops, "peak_tflops": peak_tflops, "lit_rl_mfu": flops / lit / peak_tflops}
        variant["trl_mfu"] = flops / trl / peak_tflops
    return {
        "algorithm": algorithm,
        "model": model_name,
        **variant,
        "lit_rl_s_per_step": lit,
        "trl_s_per_step": trl,
        "ratio": ratio,
        "rounds": per_round,
    }


def paired_ratio(per_round: dict[str, list[float]]) -> float:
    """lit-rl / TRL: the median over rounds of each round's ratio. A round runs both libraries back to back, so the
    machine's load of the moment is in both of its times; a ratio of the two medians could divide one round's
    lit-rl by another round's TRL (on 2 shared cores, rounds of one library differ by up to 60%)."""
    return statistics.median(lit / trl for lit, trl in zip(per_round["lit_rl"], per_round["trl"]))


def matmul_peaks(seconds: float = 1.0) -> dict[str, float]:
    """TFLOP/s of this machine's matmul peak per compute dtype, measured once for every cell of a run: the probe
    `perf/mfu` uses, for `seconds` instead of its 0.05 s (a run's own short probe, taken while the run starts up,
    gave bf16 peaks from 0.68 to 2.47 TFLOP/s across the cells of one run). On a GPU, the data sheet's."""
    import torch

    from lit_rl.training.flops import device_peak, measured_matmul_flops

    peaks = {}
    for dtype in (torch.float32, torch.bfloat16):
        if torch.cuda.is_available():
            peaks[str(dtype)] = device_peak(torch.device("cuda"), dtype).flops / 1e12
        else:
            peaks[str(dtype)] = measured_matmul_flops("cpu", dtype, seconds=seconds) / 1e12
    return peaks


def compute_dtype(setting: str) -> Optional[str]:
    """The dtype a setting's matmuls run in: fp32 when matched, bfloat16 otherwise (autocast or bf16 weights); None
    for `defaults`, where the libraries differ (lit-rl fp32, TRL bf16) and no one peak fits both."""
    return {"matched": "torch.float32", "defaults": None}.get(setting, "torch.bfloat16")


def markdown_table(results: list[dict]) -> str:
    """The README's table of a results file (a test checks the README carries exactly this); results of the
    variable-length workloads add their workload and setting."""
    variants = any("setting" in r for r in results)
    mfu = any("lit_rl_mfu" in r for r in results)
    head = "| algorithm | model | " + ("workload | setting | " if variants else "")
    lines = [
        head + "lit-rl s/step | TRL s/step | ratio |" + (" lit-rl MFU | TRL MFU |" if mfu else ""),
        "|---|---|" + ("---|---|" if variants else "") + "---|---|---|" + ("---|---|" if mfu else ""),
    ]
    for r in results:
        # A fixed-matched cell records no variant (`compare`): the default workload and setting.
        variant = f"{r.get('workload', 'fixed')} | {r.get('setting', 'matched')} | " if variants else ""
        rates = f" {100 * r['lit_rl_mfu']:.2g}% | {100 * r['trl_mfu']:.2g}% |" if mfu else ""
        lines.append(
            f"| {r['algorithm']} | {r['model']} | {variant}{r['lit_rl_s_per_step']:.3f} | {r['trl_s_per_step']:.3f} "
            f"| {r['ratio']:.2f} |{rates}"
        )
    profiled = [r for r in results if "lit_rl_phases_s" in r]
    if profiled:  # where lit-rl's step goes, one row per run; and TRL's generation where it was timed
        trl = any("trl_generation_s" in r for r in profiled)
        extra = " TRL s/step | TRL generation_s |" if trl else ""
        lines += ["", "| algorithm | model | setting | lit-rl s/step | " + " | ".join(PHASES) + " |" + extra]
        lines.append("|---|---|---|---|" + "---|" * len(PHASES) + ("---|---|" if trl else ""))
        for r in profiled:
            cells = " | ".join(f"{r['lit_rl_phases_s'][phase]:.3f}" for phase in PHASES)
            head = f"| {r['algorithm']} | {r['model']} | {r['setting']} | {r['lit_rl_s_per_step']:.3f} |"
            generation = f"{r['trl_generation_s']:.3f}" if "trl_generation_s" in r else ""
            tail = f" {r['trl_s_per_step']:.3f} | {generation} |" if trl else ""
            lines.append(f"{head} {cells} |{tail}")
    return "\n".join(lines)


def claims(results: list[dict]) -> list[str]:
    """The README's prose numbers of a results file (a test checks the README says them): the range of the ratios,
    the tiny model's GRPO step, and how far single rounds of one configuration and library spread."""
    ratios = [r["ratio"] for r in results]
    if any("lit_rl_mfu" in r for r in results):
        fastest = [r for r in results if r.get("setting") in ("fastest", "compiled")]
        return [
            f"Ratio = lit-rl / TRL on fixed 32-token completions, {min(ratios):.2f} to {max(ratios):.2f}",
            *(f"{r['algorithm']} {r['setting']}: ratio {r['ratio']:.2f} (target 0.5)" for r in fastest),
        ]
    if any("setting" in r for r in results):
        met = [r for r in results if r["ratio"] <= 0.5]
        return [
            f"Ratio = lit-rl / TRL on variable lengths, {min(ratios):.2f} to {max(ratios):.2f}",
            f"{len(met)} of {len(results)} at or below the 0.5 target",
        ]
    spread = max(max(t) / min(t) - 1 for r in results for t in r["rounds"].values())
    tiny = next(r for r in results if (r["algorithm"], r["model"]) == ("grpo", "tiny"))
    return [
        f"Ratio = lit-rl / TRL, {min(ratios):.2f} to {max(ratios):.2f}",
        f"Single rounds of the same configuration differ by up to {100 * spread:.0f}%",
        f"The tiny model's GRPO step ({1000 * tiny['lit_rl_s_per_step']:.0f} ms)",
        f"the TRL speed ratio ({min(ratios):.2f}-{max(ratios):.2f} today, 0.67 asked)",
    ]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        library, algorithm, model, steps, out, work = sys.argv[2:8]
        run = lit_run if library == "lit_rl" else trl_run
        times = run(algorithm, model, int(steps), Path(out).parent, Workload(**json.loads(work)))
        Path(out).write_text(json.dumps(times))
        if library == "lit_rl":
            (Path(out).parent / "phases.json").write_text(json.dumps(LIT_PHASES))
        elif TRL_GENERATION_S and len(TRL_GENERATION_S) == len(times):  # GRPO: one `generate` in each step's time
            phases = [{"generation_s": seconds} for seconds in TRL_GENERATION_S]
            (Path(out).parent / "phases.json").write_text(json.dumps(phases))
        elif TRL_GENERATION_S:  # e.g. several generations per step: no per-step split to report
            print(f"TRL: {len(TRL_GENERATION_S)} generate calls in {len(times)} steps, not timed", file=sys.stderr)
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithms", nargs="+", choices=["grpo", "dpo"], default=["grpo", "dpo"])
    parser.add_argument("--models", nargs="+", choices=["tiny", "20m"], default=["tiny", "20m"])
    parser.add_argument("--steps", type=int, default=None, help="20 (--quick: 6)")
    parser.add_argument("--warmup", type=int, default=None, help="5 (--quick: 2)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--workloads",
        nargs="+",
        choices=["fixed", "variable", "fixed32"],
        default=["fixed"],
        help="see the module docstring",
    )
    parser.add_argument(
        "--settings",
        nargs="+",
        choices=["matched", "defaults", "bf16", "fastest", "compiled"],
        default=["matched"],
        help="matched: both fp32 without gradient checkpointing; defaults: each library's documented defaults; "
        "bf16: both under bf16 autocast; fastest: each at its fastest documented setting (the module docstring)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny model, 6 steps (2 warm-up), 1 round")
    args = parse_report_args(parser, markdown_table, claims)
    if args.quick:
        args.models, args.rounds = ["tiny"], 1
    steps, warmup = (6, 2) if args.quick else (20, 5)  # unless given
    args.steps = steps if args.steps is None else args.steps
    args.warmup = warmup if args.warmup is None else args.warmup
    results = []
    peaks = matmul_peaks() if "fixed32" in args.workloads else {}  # before any run, on an idle machine
    with tempfile.TemporaryDirectory(prefix="lit-rl-vs-trl-") as tmp:
        sizes = {"tiny": dict(), "20m": dict(hidden_size=512, num_hidden_layers=8, intermediate_size=1024)}
        for workload in args.workloads:
            variable = workload == "variable"
            fixed32 = workload == "fixed32"
            models = {}
            for name in args.models:
                if variable:  # random weights that stop at random, for both algorithms (DPO reads no stops)
                    models[name] = build_stopping_model(Path(tmp) / f"model-{name}-stops", 5, **sizes[name])
                elif name == "tiny":
                    models[name] = resolve_model_path(TINY)
                else:
                    models[name] = str(build_random_model(Path(tmp) / f"model-{name}", **sizes[name]))
            for setting in args.settings:
                fastest = setting in ("fastest", "compiled")
                work = Workload(
                    variable=variable,
                    library_defaults=setting == "defaults",
                    bf16=setting == "bf16",
                    fastest=fastest,
                    compiled_policy=setting == "compiled",
                    # eager attention: faster than sdpa's CPU flash kernel on short bf16 sequences
                    attn_implementation="eager" if fastest else "",
                )
                if variable:
                    work.max_new_tokens = 128
                if fixed32:  # issue 34's rollout: 16 completions of exactly 32 tokens
                    work.prompts, work.max_new_tokens, work.min_new_tokens = 2, 32, 32
                for model_name in args.models:
                    for algorithm in args.algorithms:
                        place = (algorithm, model_name, models[model_name], args, Path(tmp), work, workload, setting)
                        peak = peaks.get(compute_dtype(setting)) if fixed32 else None  # MFU: fixed32 cells
                        results.append(compare(*place, peak_tflops=peak))
    print(markdown_table(results))
    if args.out:
        import trl

        write_report(args.out, results, versions={"trl": trl.__version__}, allow_dirty=args.allow_dirty)


if __name__ == "__main__":
    main()
