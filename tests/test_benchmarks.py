"""The benchmark scripts run and report what the README quotes (their numbers are measured, not asserted on time)."""

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import REPO


@pytest.mark.slow
def test_logprob_memory_quick_meets_the_memory_target_with_identical_values(tmp_path):
    out = tmp_path / "logprob.json"
    subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "logprob_memory.py"), "--quick", "--json", str(out)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    report = json.loads(out.read_text())["results"]
    assert report["vocab"] == 151_936
    # float32 sums over 151,936 logits in another order: 6.7e-6 on an Intel Xeon (AVX-512), 1.3e-5 on an AVX2 AMD EPYC.
    assert report["max_abs_diff"] <= 3e-5
    assert report["peak_memory_ratio"] <= 0.25, report  # the target, measured in one run
    assert report["naive"]["peak_mib"] > report["logits_mib"]  # the naive path really materialises fp32 logits


def test_packing_quick_computes_fewer_tokens_with_the_padded_values(tmp_path):
    out = tmp_path / "packing.json"
    subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "packing.py"), "--quick", "--out", str(out)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    report = json.loads(out.read_text())["results"]
    methods = {r["method"]: r for r in report["methods"]}
    assert methods["padded"]["tokens"] == report["padded_tokens"] > report["real_tokens"]
    assert methods["packed, one row"]["tokens"] == report["real_tokens"]  # no filler in a single row
    assert report["real_tokens"] <= methods["packed rows"]["tokens"] < report["padded_tokens"]
    for method in ("packed rows", "packed, one row"):
        assert methods[method]["max_logprob_diff"] <= 1e-5 and methods[method]["max_grad_diff_of_scale"] <= 1e-5


def test_generation_quick_skips_finished_rows_with_the_same_completions(tmp_path):
    out = tmp_path / "generation.json"
    subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "generation.py"), "--quick", "--out", str(out)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    report = json.loads(out.read_text())["results"]
    full, skipping = report["methods"]
    assert full["row_steps"] == report["rows"] * (report["completion_length"]["max"])  # prefill + decode steps
    assert report["completion_length"]["min"] < report["completion_length"]["max"]
    assert skipping["row_steps"] < full["row_steps"]
    assert skipping["same_completions"] and skipping["max_logprob_diff"] <= 1e-5


def test_run_report_summarises_first_and_last_steps(tmp_path):
    log_dir = tmp_path / "run"
    log_dir.mkdir()
    lines = ["epoch,step,train/reward,val/reward"]
    lines += [f"0,{s},{s / 10}," for s in range(1, 11)]
    lines += ["0,10,,0.9"]
    (log_dir / "metrics.csv").write_text("\n".join(lines) + "\n")
    out = tmp_path / "report.json"
    subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "run_report.py"), str(log_dir), "--window", "2", "--json", str(out)],
        check=True,
        capture_output=True,
        timeout=60,
    )
    report = json.loads(out.read_text())
    assert report["commit"] and "dirty" in report and "run_report.py" in report["command"]
    report = report["results"]
    assert report["train_first"]["train/reward"] == pytest.approx(0.15)
    assert report["train_last"]["train/reward"] == pytest.approx(0.95)
    assert report["val"] == [{"step": 10.0, "val/reward": 0.9}]


def test_plot_curves_writes_a_png(tmp_path):
    log_dir = tmp_path / "run"
    log_dir.mkdir()
    lines = ["epoch,step,train/rewards/correctness,train/loss,val/rewards/correctness"]
    lines += [f"0,{s},{s / 20},{1 / s}," for s in range(1, 21)] + ["0,10,,,0.5", "0,20,,,0.9"]
    (log_dir / "metrics.csv").write_text("\n".join(lines) + "\n")
    out = tmp_path / "curves.png"
    subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "plot_curves.py"), str(log_dir), "--out", str(out)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def _quick_report(script: str, tmp_path, *options: str) -> tuple[dict, str]:
    """Run `benchmarks/<script>.py --quick --out <tmp_path>/<script>.json *options`: the JSON report it wrote, its
    stdout."""
    out = tmp_path / f"{script}.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / f"{script}.py"), "--quick", "--out", str(out), *options],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    return json.loads(out.read_text()), result.stdout


@pytest.mark.slow
def test_throughput_quick_reports_a_runs_split_table_and_plot(tmp_path):
    """The script's report, table and plot, on HF `generate`: the colocated engine's run through the same code
    (`throughput.run_one`) is the gpu_suite smoke's, and its push and log-prob gap are test_vllm's."""
    report, stdout = _quick_report("throughput", tmp_path, "--engines", "hf")
    assert report["commit"] and report["versions"]["vllm"] and "--quick" in report["command"]
    (r,) = report["results"]
    assert r["engine"] == "hf" and r["steps_measured"] == 5 and r["step_s"] > 0 and r["samples_per_s"] > 0
    assert r["peak_memory_mib_per_rank"] > 0
    # The split accounts for the whole step: the parts add up to the step time.
    assert sum(r["split_s"].values()) == pytest.approx(r["step_s"], rel=1e-3)
    assert r["split_s"]["weight_push"] == 0.0  # generate runs on the policy: nothing to push
    assert (tmp_path / "throughput.png").stat().st_size > 0
    assert "s/step" in stdout


@pytest.mark.slow
def test_lora_quick_reports_fewer_trainable_parameters_and_a_smaller_checkpoint(tmp_path):
    report, _ = _quick_report("lora", tmp_path)
    full, lora = (next(r for r in report["results"] if r["lora"] is flag) for flag in (False, True))
    assert full["trainable_parameters"] == full["total_parameters"]
    assert lora["trainable_parameters"] < 0.25 * full["trainable_parameters"]
    assert lora["checkpoint_mib"] < 0.3 * full["checkpoint_mib"]
    assert full["peak_memory_mib"] > 0 and lora["peak_memory_mib"] > 0


@pytest.mark.slow
def test_precision_quick_runs_the_demo_in_fp32_and_bf16_and_compares_their_accuracy(tmp_path):
    report, stdout = _quick_report("precision", tmp_path)
    fp32, bf16 = report["results"]
    assert (fp32["precision"], bf16["precision"]) == ("32-true", "bf16-mixed")
    for row in (fp32, bf16):
        assert 0 <= row["accuracy"] <= 1 and row["accuracy_step"] == 2 and row["step_s"] > 0 and 0 < row["mfu"] < 1
    assert "| trainer.precision | greedy held-out accuracy | vs fp32 |" in stdout
    assert "bf16-mixed: " in stdout and " points from fp32 (" in stdout


@pytest.mark.slow
def test_compiled_decoding_quick_reports_speed_compile_time_and_the_same_tokens(tmp_path):
    report, stdout = _quick_report("compiled_decoding", tmp_path)
    (row,) = report["results"]
    assert row["dtype"] == "float32" and row["eager_s"] > 0 and row["compiled_s"] > 0
    assert row["speedup"] == pytest.approx(row["eager_s"] / row["compiled_s"])
    assert row["compile_s"] > 0 and len(row["warm_generations_s"]) == 3
    assert row["tokens_equal"] == 1.0  # float32: the eager tokens exactly
    assert row["max_logprob_gap_compiled"] <= row["max_logprob_gap_eager"] + 1e-5
    assert "| weights | eager s/generation | compiled |" in stdout and "float32: compiled decoding " in stdout
    # The floor: the weight matmuls alone, a part of what a generation computes; every Linear's weight once.
    assert 0 < row["weight_matmuls_s"] < row["compiled_s"]
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM(_benchmark_module("compiled_decoding").model_config("tiny"))
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert row["weight_bytes"] == sum(4 * m.weight.numel() for m in linears)  # float32
    # On CPU: the compiled step without packed weights or inductor's option, in the same rounds.
    assert row["untuned_compiled_s"] > 0 and row["untuned_compile_s"] is not None
    assert "| untuned compiled s | compiled / untuned |" in stdout and "takes " in stdout


def test_packed_linear_quick_times_each_product_both_ways_with_its_packing(tmp_path):
    report, stdout = _quick_report("packed_linear", tmp_path)
    rows = report["results"]
    dtypes = [str(dtype).removeprefix("torch.") for dtype in _benchmark_module("packed_linear").measured_dtypes()]
    assert dtypes[0] == "float32"  # bfloat16 too where the CPU has bf16 instructions
    assert [(r["dtype"], r["shape"]) for r in rows] == [
        (dtype, shape) for dtype in dtypes for shape in ([128, 128], [512, 512])
    ]
    for r in rows:
        assert r["f_linear_us"] > 0 and r["packed_us"] > 0 and r["pack_us"] > 0 and r["rows"] == 16
        assert r["packed_over_f_linear"] == pytest.approx(r["packed_us"] / r["f_linear_us"])
        saved = r["f_linear_us"] - r["packed_us"]
        assert r["break_even_tokens"] == (pytest.approx(r["pack_us"] / saved) if saved > 0 else None)
        assert r["copies"] * r["weight_kib"] >= 8 * 1024 - r["weight_kib"]  # each call reads its weight from memory
    assert "| weights | shape | KiB | F.linear us | packed us |" in stdout


@pytest.mark.slow
def test_train_mfu_quick_reports_each_precision_against_its_peak_and_profiles_fp32(tmp_path):
    report, stdout = _quick_report("train_mfu", tmp_path)
    results = report["results"]
    assert [r["setting"] for r in results["passes"]] == [
        "fp32",
        "fp32-attn-eager",
        "bf16-mixed",
        "bf16-true",
        "bf16-true-attn-eager",
    ]
    for r in results["passes"]:
        assert r["pass_s"] > 0 and r["passes"] == 3
        assert r["mfu"] == pytest.approx(results["model_flops"] / r["pass_s"] / (r["peak_tflops"] * 1e12))
        assert 0 < r["mfu"] < 1
    profile = results["fp32_profile"]
    assert 0 < profile["matmul_share"] < 1 and 0 <= profile["attention_share"] < 1 - profile["matmul_share"]
    assert len(profile["largest_others"]) == 5
    assert all(not other["op"].startswith(("aten::mm", "aten::addmm")) for other in profile["largest_others"])
    assert all(r["first_pass_s"] > 0 for r in results["passes"])
    assert "| setting | s/pass (forward + backward) |" in stdout and "fp32: the training pass reaches" in stdout
    assert "bf16-true-attn-eager: " in stdout and "x the speed of bf16-true's sdpa attention" in stdout


@pytest.mark.slow
def test_trl_comparison_quick_times_both_libraries_on_both_algorithms_and_workloads(tmp_path):
    """`--quick` on both workloads in one run (each library started once per algorithm and workload, as any run
    starts them), two steps each, the first left out as warm-up: one measured step of each library, algorithm and
    workload is what the assertions read (its time, and its phases against it)."""
    out = tmp_path / "compare.json"
    command = [sys.executable, str(REPO / "benchmarks" / "compare_trl.py"), "--quick", "--workloads", "fixed"]
    command += ["variable", "--steps", "2", "--warmup", "1", "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    report = json.loads(out.read_text())
    assert report["versions"]["trl"] and "--quick" in report["command"]
    results = report["results"]
    assert [(r["algorithm"], r["model"], r.get("workload", "fixed")) for r in results] == [
        ("grpo", "tiny", "fixed"),
        ("dpo", "tiny", "fixed"),
        ("grpo", "tiny", "variable"),
        ("dpo", "tiny", "variable"),
    ]
    for r in results:
        assert r["lit_rl_s_per_step"] > 0 and r["trl_s_per_step"] > 0
        assert r["ratio"] == pytest.approx(r["lit_rl_s_per_step"] / r["trl_s_per_step"])
    table = result.stdout
    assert "| grpo | tiny | fixed | matched |" in table and "| dpo | tiny | variable | matched |" in table
    assert _benchmark_module("compare_trl").claims(results)  # the --markdown path reads mixed rows too
    # Where lit-rl's step goes on the variable-length workload: GRPO samples and updates; DPO runs its reference
    # and updates, and samples nothing.
    variable = [r for r in results if r.get("workload") == "variable"]
    assert all(r["setting"] == "matched" for r in variable)
    grpo, dpo = (r["lit_rl_phases_s"] for r in variable)
    assert grpo["generation_s"] > 0 and grpo["policy_update_s"] > 0 and grpo["ref_logprobs_s"] == 0
    assert dpo["generation_s"] == 0 and dpo["policy_update_s"] > 0 and dpo["ref_logprobs_s"] > 0
    for result_row in variable:
        assert sum(result_row["lit_rl_phases_s"].values()) <= 1.5 * result_row["lit_rl_s_per_step"]


def test_the_variable_length_workloads_vary_in_length(tmp_path):
    compare_trl = _benchmark_module("compare_trl")
    pairs = compare_trl.variable_pairs(count=64)
    lengths = [len(pair[key]) for pair in pairs for key in ("chosen", "rejected")]
    assert min(lengths) >= 32 and max(lengths) <= 128 and len(set(lengths)) > 20
    assert compare_trl.length_reward(None, ["ab", "x" * 200]) == [2 / 128, 1.0]
    from lit_rl.modeling.models import load_causal_lm, load_tokenizer, model_eos_token_ids
    from lit_rl.rollout import HFGenerateEngine, SamplingParams

    path = compare_trl.build_stopping_model(tmp_path / "model", 5, hidden_size=64, num_hidden_layers=1)
    tokenizer, model = load_tokenizer(path), load_causal_lm(path)
    stops = model_eos_token_ids(model, tokenizer.eos_token_id)
    assert len(stops) == 6  # EOS and the 5 stop ids, read from the generation config as both libraries do
    prompts = tokenizer(["12+34="] * 32, return_tensors="pt")
    params = SamplingParams(max_new_tokens=128, temperature=1.0)
    out = HFGenerateEngine(model, stops, tokenizer.pad_token_id).generate(
        prompts["input_ids"], prompts["attention_mask"], params, list(range(32))
    )
    lengths = out.completion_mask.sum(dim=1)
    assert lengths.min() < 32 and lengths.max() > 64  # stops at random, far apart


def test_weight_push_benchmark_times_and_splits_the_colocated_push(tmp_path):
    out = tmp_path / "push.json"
    subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "weight_push.py"), "--pushes", "3", "--profiled-pushes", "2"]
        + ["--json", str(out)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    report = json.loads(out.read_text())
    (result,) = report["results"]
    assert result["tensors"] > 0 and 0 < result["push_s_mean"] < 60
    shares = result["profiled_shares"]
    # Nested parts: the re-pack is inside load_weights, which is inside reload_weights, inside the push.
    assert 0 <= shares["re-pack for the CPU GEMM kernels"] <= shares["vLLM load_weights (re-pack included)"]
    assert shares["vLLM load_weights (re-pack included)"] > 0
    assert shares["vLLM load_weights (re-pack included)"] <= shares["reload_weights in all"] <= 1.0


@pytest.mark.slow
def test_push_memory_quick_holds_about_one_bucket_under_zero3(tmp_path):
    out = tmp_path / "push_memory.json"
    subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "push_memory.py"), "--quick", "--out", str(out)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    whole, bucketed = json.loads(out.read_text())["results"]
    assert whole["push"] == "whole" and bucketed["bucket_mib"] == 0.5
    # The whole gather holds about the model; a bucketed push about one bucket (here one decoder layer) plus the
    # largest tensor. Measured (2 ranks, tiny model, the largest of 3 pushes, 5 runs): 3.3 to 4.0 MiB against 1.0 to
    # 1.3 MiB, bound 1.3 MiB. The 25% margin is for what the collectives allocate beside the gathered parameters.
    # The whole gather's floor is the half of the model the other rank holds: a single push measured as little as
    # 2.6 MiB of 4.3 (small tensors reuse heap the warm-up freed), under the 0.6 this asked for before.
    assert whole["extra_mib"] > 0.5 * whole["model_mib"]
    assert bucketed["extra_mib"] <= 1.25 * bucketed["bound_mib"]
    assert bucketed["extra_mib"] < 0.5 * whole["extra_mib"]


@pytest.mark.slow
def test_gpu_suite_pipeline_runs_on_cpu_and_refuses_to_measure_without_a_gpu(tmp_path, monkeypatch, capsys):
    module = _benchmark_module("gpu_suite")
    # The refusal is `main()` as the script runs it, in this process: a process of its own would only add the
    # imports (about 7 s of CI time).
    monkeypatch.setattr(sys, "argv", [str(REPO / "benchmarks" / "gpu_suite.py")])
    with pytest.raises(SystemExit) as refused:
        module.main()
    assert refused.value.code == 2 and "no CUDA device" in capsys.readouterr().err
    suite = [sys.executable, str(REPO / "benchmarks" / "gpu_suite.py")]
    out = tmp_path / "smoke.json"
    # Two steps, the first left out as warm-up, are all the assertions need: the measured step pushes the weights
    # the first step trained (`--steps 2 1`; the smoke's default is 4 steps, 1 left out). One run per code path of
    # the suite: `hf_compiled` is the `hf` part's loop with another engine name, ZeRO-3 the `strategies` part's
    # loop with another strategy (`tests/gpu/test_gpu.py` trains with both on a GPU; ZeRO-3's push into the
    # colocated engine is test_deepspeed's, and ZeRO-2's, run here, is run nowhere else). The `trl` part's processes
    # are `compare_trl.run_child`'s, which `test_trl_comparison_quick...` starts for both libraries; its own
    # arithmetic is `test_the_gpu_suites_trl_ratio_alternates_the_libraries_and_divides_their_medians`.
    parts = ["--parts", "vllm", "hf", "strategies", "--strategies", "deepspeed_zero2"]
    smoke = [*suite, "--cpu-smoke", *parts, "--steps", "2", "1", "--out", str(out)]
    subprocess.run(smoke, check=True, capture_output=True, timeout=900)
    report = json.loads(out.read_text())
    runs = {r["name"]: r for r in report["results"]["runs"]}
    expected = {"vllm smoke", "hf smoke", "vllm smoke deepspeed_zero2"}
    assert set(runs) == expected
    assert not any("error" in r for r in runs.values()), runs
    assert runs["vllm smoke"]["split_s"]["weight_push"] > 0 and runs["hf smoke"]["split_s"]["weight_push"] == 0
    # The split accounts for the whole step (`throughput.run_one`, as `throughput.py` reports it).
    assert all(sum(r["split_s"].values()) == pytest.approx(r["step_s"], rel=1e-3) for r in runs.values()), runs
    assert all(r["rollout_kl_mean"] > 0 for r in runs.values())  # bf16 on both sides of every run
    assert report["results"]["comparisons"] == []
    assert [t["target"] for t in module.targets(report["results"])] == [
        "weight push share of the step (0.5B)",
        "vLLM / HF generate, generated tokens/s",
    ]
    table = module.markdown_table(report["results"]).splitlines()
    hf_row = next(line for line in table if line.startswith("| hf smoke |"))
    cells = [cell.strip() for cell in hf_row.strip("|").split("|")]
    assert cells[3:6] == ["", "", ""]  # HF `generate` pushes nothing: no push share, no engine-trainer gap
    # Every run keeps its utilisation (on CPU over the measured matmul peak), and the table shows it.
    assert all(0 < r["mfu"] < 1 and 0 < r["update_mfu"] < 1 for r in runs.values()), runs
    assert cells[7] == f"{100 * runs['hf smoke']['mfu']:.1f}% ({100 * runs['hf smoke']['update_mfu']:.1f}%)"


@pytest.mark.parametrize("engine", ["vllm_colocate", "hf_compiled"])
def test_the_gpu_suites_trl_ratio_alternates_the_libraries_and_divides_their_medians(tmp_path, monkeypatch, engine):
    """`gpu_suite.trl_ratio` with `run_child` (the processes, which the compare_trl tests start) answering each
    run's per-step times: the libraries alternate round by round, the warm-up steps are left out, and the ratio is
    lit-rl's median over the faster TRL setting's (under `hf_compiled`, TRL also runs with its static cache)."""
    module = _benchmark_module("gpu_suite")
    started = []
    times = {"lit_rl": [9.0, 2.0, 2.2], "trl": [9.0, 4.0, 4.4], "trl_static": [9.0, 3.0, 3.2]}

    def run_child(library, algorithm, model, steps, run_dir, work):
        kind = "trl_static" if library == "trl" and work.trl_cache_implementation == "static" else library
        started.append((kind, algorithm, run_dir.name))
        return times[kind]

    monkeypatch.setattr(module, "run_child", run_child)
    work = module.workload(True, engine)
    work.steps, work.warmup = 3, 1
    comparison = module.trl_ratio("model", work, tmp_path, rounds=2, engine=engine)
    kinds = ["lit_rl", "trl"] + (["trl_static"] if engine == "hf_compiled" else [])
    assert [kind for kind, _, _ in started] == kinds * 2 and {a for _, a, _ in started} == {"grpo"}
    assert comparison["lit_rl_s_per_step"] == pytest.approx(2.1)  # the median of steps 2 and 3, in both rounds
    faster_trl = 3.1 if engine == "hf_compiled" else 4.2
    assert comparison["trl_s_per_step"] == pytest.approx(faster_trl)
    assert comparison["ratio"] == pytest.approx(2.1 / faster_trl)
    targets = module.targets({"runs": [], "comparisons": [comparison | {"engine": engine}]})
    assert [t["target"] for t in targets] == [
        "lit-rl / TRL, s per step"
        + ("" if engine == "vllm_colocate" else " (HF decoding: lit-rl compiled, TRL's faster)")
    ]


def _benchmark_module(script: str):
    """benchmarks/<script>.py, imported by path (benchmarks/ is not a package)."""
    import importlib.util

    sys.path.insert(0, str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location(script, REPO / "benchmarks" / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[script] = module
    spec.loader.exec_module(module)
    return module


def _git_checkout(tmp_path, files: dict[str, str]):
    """A temporary git checkout with benchmarks/provenance.py, benchmarks/run_report.py and `files` committed."""
    import shutil

    repo = tmp_path / "repo"
    (repo / "benchmarks" / "results").mkdir(parents=True)
    for name in ("provenance.py", "run_report.py"):
        shutil.copy(REPO / "benchmarks" / name, repo / "benchmarks" / name)
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    git = ["git", "-C", str(repo), "-c", "user.name=test", "-c", "user.email=test@example.com"]
    for command in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "init"]):
        subprocess.run([*git, *command], check=True, capture_output=True)
    commit = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    return repo, commit


def test_results_path_is_refused_from_a_dirty_tree_unless_allowed_and_then_marked_dirty(tmp_path):
    provenance = _benchmark_module("provenance")
    repo, commit = _git_checkout(tmp_path, {"tracked.txt": "clean\n"})
    results = repo / "benchmarks" / "results" / "bench.json"
    (repo / "benchmarks" / "results" / "earlier.json").write_text("{}")  # results being written are not dirt
    assert provenance.dirty_files(repo) == []
    provenance.write_report(results, [{"x": 1}], repo=repo)
    clean = json.loads(results.read_text())
    assert clean["commit"] == commit and clean["dirty"] is False and "dirty_files" not in clean
    (repo / "tracked.txt").write_text("edited\n")
    (repo / "new.py").write_text("")
    assert sorted(provenance.dirty_files(repo)) == ["new.py", "tracked.txt"]
    results.unlink()
    with pytest.raises(SystemExit) as refused:
        provenance.write_report(results, [{"x": 1}], repo=repo)
    message = str(refused.value)
    assert "\n" not in message and "tracked.txt" in message and "new.py" in message and "--allow-dirty" in message
    assert not results.exists()
    provenance.write_report(results, [{"x": 1}], allow_dirty=True, repo=repo)
    allowed = json.loads(results.read_text())
    assert allowed["dirty"] is True and sorted(allowed["dirty_files"]) == ["new.py", "tracked.txt"]
    elsewhere = tmp_path / "elsewhere.json"  # outside benchmarks/results/: written, and recorded as dirty
    provenance.write_report(elsewhere, [{"x": 1}], repo=repo)
    assert json.loads(elsewhere.read_text())["dirty"] is True


def test_a_results_file_names_the_cpu_model_and_its_matmul_instruction_sets(tmp_path):
    """Two machines of the same architecture give other numbers (an EPYC without AMX and a Xeon with it, both
    `x86_64`): the machine record says which CPU ran."""
    provenance = _benchmark_module("provenance")
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nmodel name\t: Example CPU 9000\nflags\t\t: fpu sse avx2 avx512f avx512_bf16\n\n"
        "processor\t: 1\nmodel name\t: Example CPU 9000\nflags\t\t: fpu sse avx2 avx512f avx512_bf16\n"
    )
    assert provenance.cpu_model(cpuinfo) == {
        "cpu": "Example CPU 9000",
        "cpu_features": ["avx512_bf16", "avx512f", "avx2"],
    }
    assert provenance.cpu_model(tmp_path / "absent") == {}  # not Linux: nothing, and no error
    assert set(provenance.cpu_model()) <= set(provenance.environment()["machine"])


def test_source_tree_names_an_earlier_commit_after_later_commits_changed_its_results(tmp_path):
    """A lent GPU machine's dirty-looking tree is matched to the commit whose files it ran, even when a results file
    changed after that commit (the CI of stop 39 failed there: `git rm --cached` refused without `-f`)."""
    provenance = _benchmark_module("provenance")
    repo, first = _git_checkout(tmp_path, {"tracked.txt": "one\n", "benchmarks/results/old.json": "{}"})
    ran = provenance.source_tree(repo)  # the working tree as the GPU machine would have run it
    git = ["git", "-C", str(repo), "-c", "user.name=test", "-c", "user.email=test@example.com"]
    (repo / "benchmarks" / "results" / "old.json").write_text('{"x": 1}')
    (repo / "tracked.txt").write_text("two\n")
    subprocess.run([*git, "commit", "-q", "-am", "later"], check=True, capture_output=True)
    (repo / "benchmarks" / "results" / "old.json").write_text('{"x": 2}')  # and an uncommitted result beside it
    assert provenance.source_tree(repo, first) == ran
    assert provenance.source_tree(repo, "HEAD") not in (None, ran)


def test_lit_rl_imported_from_another_checkout_counts_as_dirty(tmp_path):
    provenance = _benchmark_module("provenance")
    repo, _ = _git_checkout(tmp_path, {"lit_rl/__init__.py": ""})
    # This process imports lit_rl from the repository under test, not from the temporary checkout.
    (entry,) = provenance.dirty_files(repo)
    assert entry.startswith("lit_rl (imported from ")


def test_a_script_refuses_results_from_a_dirty_tree_in_one_line_and_allow_dirty_says_so(tmp_path):
    repo, _ = _git_checkout(tmp_path, {"tracked.txt": "clean\n"})
    (repo / "tracked.txt").write_text("edited\n")
    log_dir = tmp_path / "run"
    log_dir.mkdir()
    (log_dir / "metrics.csv").write_text("epoch,step,train/reward\n0,1,0.5\n0,2,0.7\n")
    out = repo / "benchmarks" / "results" / "run.json"
    command = [sys.executable, str(repo / "benchmarks" / "run_report.py"), str(log_dir), "--json", str(out)]
    refused = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and not out.exists()
    (line,) = refused.stderr.strip().splitlines()
    assert line.startswith("run_report.py: error: refusing to write") and "tracked.txt" in line
    subprocess.run([*command, "--allow-dirty"], check=True, capture_output=True, timeout=120)
    report = json.loads(out.read_text())
    assert report["dirty"] is True and report["dirty_files"] == ["tracked.txt"]
    assert report["results"]["train_last"]["train/reward"] == pytest.approx(0.6)


def test_parse_report_args_prints_a_results_file_or_refuses_a_dirty_results_path_before_measuring(
    tmp_path, monkeypatch, capsys
):
    """The command line every quoted benchmark shares: `--markdown` prints the file's table and claims and exits 0;
    `--out` into a dirty checkout's benchmarks/results/ exits with the one-line refusal; otherwise the options come
    back to measure with."""
    import argparse

    provenance = _benchmark_module("provenance")
    results = tmp_path / "bench.json"
    results.write_text(json.dumps({"results": [{"x": 1}]}))
    table, claims = (lambda r: f"| x | {r[0]['x']} |"), (lambda r: [f"x is {r[0]['x']}"])
    monkeypatch.setattr(sys, "argv", ["bench.py", "--markdown", str(results)])
    with pytest.raises(SystemExit) as printed:
        provenance.parse_report_args(argparse.ArgumentParser(), table, claims)
    assert printed.value.code == 0 and capsys.readouterr().out == "| x | 1 |\nx is 1\n"
    repo, _ = _git_checkout(tmp_path, {"tracked.txt": "clean\n"})
    (repo / "tracked.txt").write_text("edited\n")
    out = repo / "benchmarks" / "results" / "bench.json"
    monkeypatch.setattr(sys, "argv", ["bench.py", "--out", str(out)])
    with pytest.raises(SystemExit) as refused:
        provenance.parse_report_args(argparse.ArgumentParser(), table, claims, repo=repo)
    assert "refusing to write" in str(refused.value) and "tracked.txt" in str(refused.value)
    monkeypatch.setattr(sys, "argv", ["bench.py", "--out", str(out), "--allow-dirty"])
    args = provenance.parse_report_args(argparse.ArgumentParser(), table, claims, repo=repo)
    assert args.out == out and args.allow_dirty and args.markdown is None


def _fit_summary(run_report, rewards: list[float], val: list[tuple[int, dict]], **model) -> dict:
    """A demo's `fit` entry from made-up per-step values (perf/step_s 0.1 every step)."""
    train = [{"step": s + 1, "train/rewards/correctness": r, "train/reward": r + 0.1} for s, r in enumerate(rewards)]
    for row in train:
        row |= {"perf/step_s": 0.1, "perf/generation_s": 0.03, "perf/policy_update_s": 0.07}
        row["train/frac_tied_pairs"] = 0.5 if row["step"] <= 2 else 0.25
    rows = [{"step": step, **values} for step, values in val]
    summary = run_report.summarise(train, rows, window=2)
    return summary | {"command": "lit-rl fit --config configs/x.yaml", "wall_s": 112.4, "model": model}


def test_run_report_renders_the_demo_tables_and_numbers():
    run_report = _benchmark_module("run_report")
    val = [(s, {"val/rewards/correctness": 0.5 + s / 100}) for s in (2, 4)]
    grpo = {"demo": "grpo", "fit": _fit_summary(run_report, [0.1, 0.2, 0.3, 0.5], val, temperature=1.0)}
    grpo["start"] = {"val": {"val/rewards/correctness": 0.4}}
    table = run_report.markdown_table(grpo)
    assert "mean of the first / last 2 steps, temperature 1) | 0.150 | 0.400 |" in table
    assert table.endswith("| 0.400 (step 0) | 0.540 (step 4) |")
    assert run_report.claims(grpo) == [
        "Wall time of the whole command: **1 min 52 s**",
        "# step 0: val/rewards/correctness 0.4000",
        "moves between 0.520 and 0.540 over the last 2 validations (steps 2 to 4)",
        "medians over the 4 steps of the GRPO demo: 0.100 s per step, 0.030 s generation, 0.070 s policy update",
    ]
    dpo_val = [(s, {"val/rewards/accuracies": s / 10, "val/loss": 0.6}) for s in (2, 4)]
    dpo = {"demo": "dpo", "fit": _fit_summary(run_report, [0.0] * 4, dpo_val)}
    dpo |= {"start": {"val": {"val/rewards/accuracies": 0.0, "val/loss": 0.693}}}
    dpo |= {
        "task_start": {"val": {"val/rewards/correctness": 0.6}},
        "task_end": {"val": {"val/rewards/correctness": 0.7}},
    }
    assert run_report.markdown_table(dpo).splitlines() == [
        "| | start | step 2 | step 4 |",
        "|---|---|---|---|",
        "| preference accuracy (`val/rewards/accuracies`, 256 held-out pairs) | 0.000 (*) | 0.200 | 0.400 |",
        "| `val/loss` | 0.693 | 0.600 | 0.600 |",
        "| greedy task accuracy on the 256 held-out prompts | 0.600 | | 0.700 |",
    ]
    online = {"demo": "online_dpo", "fit": _fit_summary(run_report, [0.2] * 4, val, num_generations=2)}
    online["start"] = {"val": {"val/rewards/correctness": 0.4}}
    rloo = online | {"demo": "rloo", "fit": online["fit"] | {"model": {"num_generations": 8}, "wall_s": 56.0}}
    assert run_report.markdown_table([rloo, online]).splitlines()[2:] == [
        "| `lit-rl fit --config configs/x.yaml` (k = 8) | 56 s | 0.300 -> 0.300 | 0.200 -> 0.200 | 0.400 -> 0.540 |",
        "| `lit-rl fit --config configs/x.yaml` (2 samples per prompt) | 1 min 52 s | 0.300 -> 0.300 | 0.200 -> 0.200 "
        "| 0.400 -> 0.540 |",
    ]
    assert run_report.claims(online) == ["skipped 50% of its pairs as ties in the first 2 steps and 25% in the last 2"]


def test_ci_time_reads_pytest_summary_and_renders_the_readme_sentence():
    ci_time = _benchmark_module("ci_time")
    output = "collected 343 items\n...\n==== 340 passed, 3 skipped, 7 warnings in 1217.43s (0:20:17) ====\n"
    summary = ci_time.parse_pytest_summary(output)
    assert summary == {"tests_s": 1217.43, "passed": 340, "skipped": 3, "warnings": 7}
    results = summary | {"total_s": 1355.0, "install_s": 137.57, "cores": 2, "commit": "6c547593dd1b"}
    assert ci_time.claims(results) == [
        "`bash .ci/run` took 22 min 35 s on 2 cores at 6c54759: about 2 min 18 s to install, 20 min 17 s of tests "
        "(340 passed, 3 skipped)."
    ]
    durations = "=== slowest 25 durations ===\n3.01s setup    tests/a.py::test_y\n"
    durations += "92.31s call     tests/b.py::test_x[a b]\n"
    assert ci_time.slowest_tests(durations + output) == [
        {"test": "tests/b.py::test_x[a b]", "phase": "call", "seconds": 92.31},
        {"test": "tests/a.py::test_y", "phase": "setup", "seconds": 3.01},
    ]
    # A failed run keeps pytest's tracebacks (what a flaky failure needs to be read afterwards).
    failures = "=================== FAILURES ===================\n____ test_x ____\nE   assert 2 == 3\n"
    failed = "..\n" + failures + "=== short test summary info ===\nFAILED tests/b.py::test_x\n" + output
    assert ci_time.failure_report(failed).startswith(failures) and "FAILED" not in ci_time.failure_report(failed)
    assert ci_time.failure_report(output) == ""


@pytest.mark.slow
def test_long_completions_quick_reports_both_libraries_peak_rss_on_completions_within_bounds(tmp_path):
    out = tmp_path / "long.json"
    command = [sys.executable, str(REPO / "benchmarks" / "long_completions.py"), "--quick", "--out", str(out)]
    subprocess.run(command, check=True, capture_output=True, timeout=600)
    report = json.loads(out.read_text())
    assert (report["vocab"], report["min_new_tokens"], report["max_new_tokens"]) == (8192, 16, 48)
    runs = {r["run"]: r for r in report["results"]}
    assert set(runs) == {"lit-rl, head chunks", "lit-rl, whole logits", "TRL"}
    for run in runs.values():
        # No completion stopped before min_new_tokens in either library (the stops are sampled otherwise).
        assert 16 <= run["min_length"] <= run["max_length"] <= 48, run
        assert run["peak_rss_mib"] > 100 and len(run["step_times"]) == 2


def test_the_agentic_benchmark_reads_the_servers_idle_share_and_the_staleness_histogram(tmp_path):
    """`benchmarks/agentic.py` reads each run's CSV as Lightning writes it (perf/ and train/ on rows of their own),
    leaves the first step out, and its table shows the server's idle share and the share of samples by staleness."""
    agentic = _benchmark_module("agentic")
    header = "step,perf/step_s,perf/generation_s,perf/engine_idle_share,train/staleness/mean,"
    header += "train/staleness/share_0,train/staleness/share_1\n"
    rows = [
        "0,9.0,8.0,0.9,,,\n",
        "0,,,,0.0,1.0,0.0\n",  # the first step: start-up, left out
        "1,2.0,1.0,0.25,,,\n",
        "1,,,,1.0,0.0,1.0\n",
        "2,4.0,1.0,0.75,,,\n",
        "2,,,,0.5,0.5,0.5\n",
    ]
    csv = tmp_path / "metrics.csv"
    csv.write_text(header + "".join(rows))
    run = agentic.run_metrics(csv)
    assert run == {
        "step_s": 3.0,
        "generation_s": 1.0,
        "staleness_mean": 0.75,
        "engine_idle_share": 0.5,
        "staleness_shares": [0.25, 0.75],
    }
    row = agentic.summarise("asynchronous k=1", 0.1, [run])
    lock_step = {**row, "mode": "lock-step, one call at a time", "engine": "HF generate", "step_s": 12.0}
    for key in ("engine_idle_share", "staleness_shares"):  # HF rows log neither
        lock_step.pop(key)
    lines = agentic.markdown_table([lock_step, row]).splitlines()
    assert lines[2].startswith("| 100 ms | HF generate | lock-step, one call at a time | 12.00 | 33% |  |  | ")
    assert lines[3] == "| 100 ms | vLLM server | asynchronous k=1 | 3.00 | 33% | 50% | 25% / 75% | 21.3 | 4.0x |"


def test_scaling_model_adds_the_phases_shares_cores_and_overlaps_generation_when_stale():
    scaling = _benchmark_module("scaling_model")
    inputs = scaling.Inputs(
        generated_tokens=10,
        trained_tokens=30,
        logprob_passes=1,
        generation_tokens_per_s=100,
        train_tokens_per_s=300,
        forward_tokens_per_s=600,
        reward_s=0.01,
        grad_bytes=1000,
        push_bytes=500,
        push_bytes_per_s=1000,
        allreduce={4: (0.1, 0.001)},
        collectives_per_step=10,
        collective_latency={4: 0.01},
        cores=2,
        core_efficiency={2: 0.5},
    )
    # 8 completions on 4 processes sharing 2 cores at half speed each: s = (2 / 4) * 0.5 = 0.25.
    out = scaling.predict(inputs, completions=8, trainers=4)
    assert out["phases_s"] == pytest.approx(
        {
            "generation": 2 * 10 / (100 * 0.25),
            "reward": 2 * 0.01 / 0.25,
            "logprobs": 2 * 30 / (600 * 0.25),
            "update": 2 * 30 / (300 * 0.25),
            "allreduce": 0.1 + 0.001 * 1000,
            "sync": 10 * 0.01,
            "push": 0.5,
        }
    )
    assert out["step_s"] == pytest.approx(sum(out["phases_s"].values()))
    assert out["generated_tokens_per_s"] == pytest.approx(8 * 10 / out["step_s"])
    # Two servers generate all 8 completions; one step stale, generation overlaps the trainer's side.
    gpu = scaling.Inputs(**{**vars(inputs), "cores": None})
    stale = scaling.predict(gpu, completions=8, trainers=4, servers=2, stale=True)
    trainer_side = sum(stale["phases_s"][k] for k in ("reward", "logprobs", "update", "allreduce", "sync"))
    assert stale["phases_s"]["generation"] == pytest.approx(8 * 10 / (2 * 100))
    assert stale["step_s"] == pytest.approx(max(stale["phases_s"]["generation"], trainer_side) + 0.5)


def test_scaling_model_roofline_and_projection_rows():
    scaling = _benchmark_module("scaling_model")
    # One H100 decoding 256 sequences of a 7B model: weights plus KV cache per step at HBM speed, half efficient.
    step_bytes = 2 * 7.6e9 + 256 * 500 * 57344
    assert scaling.decode_tokens_per_s() == pytest.approx(0.5 * 256 * 3.35e12 / step_bytes)
    rows = scaling.projection(http_bytes_per_s=1e9, collectives_per_step=9)
    assert {(r["trainers"], r["servers"], r["stale"], r["push"]) for r in rows} >= {(16, 0, False, "in place")}
    http = [r for r in rows if r["push"] == "http"]
    nccl = [r for r in rows if r["push"] == "nccl"]
    assert all(r["phases_s"]["push"] == pytest.approx(2 * 7.6e9 / 1e9) for r in http)
    assert all(h["step_s"] > n["step_s"] for h, n in zip(http, nccl))


@pytest.mark.slow
def test_weight_transport_measures_both_ways_on_the_same_bytes(tmp_path):
    out = tmp_path / "transport.json"
    script = REPO / "benchmarks" / "weight_transport.py"
    command = [sys.executable, str(script), "--megabytes", "2", "--tensors", "4", "--rounds", "2", "--out", str(out)]
    subprocess.run(command, check=True, capture_output=True, timeout=300)
    report = json.loads(out.read_text())["results"]
    assert report["megabytes"] == pytest.approx(2 * 2**20 / 1e6) and report["tensors"] == 4
    for way in ("http", "gloo"):
        assert len(report["mb_per_s"][way]) == 2 and all(rate > 0 for rate in report["mb_per_s"][way])
    ratio = report["median_mb_per_s"]["gloo"] / report["median_mb_per_s"]["http"]
    assert report["gloo_over_http"] == pytest.approx(ratio)


@pytest.mark.slow
def test_decode_overhead_times_lit_rls_decoding_and_plain_generate():
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "decode_overhead.py"), "--quick"],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    printed = dict(line.split(": ", 1) for line in result.stdout.splitlines())
    assert printed["device"] in {"cpu", "cuda"}
    seconds = [float(printed[name]) for name in ("lit-rl HF engine s", "generate(do_sample=True) s")]
    assert all(value > 0 for value in seconds)
    # The script prints all three to 4 significant figures (`.4g`), each off by at most 5e-4 relative, so the ratio
    # of the printed seconds and the printed ratio can differ by up to (1 + 5e-4)**2 / (1 - 5e-4) - 1 < 1.6e-3.
    assert float(printed["lit-rl / generate"]) == pytest.approx(seconds[0] / seconds[1], rel=1.6e-3)


def test_fixed32_cells_report_both_libraries_mfu_from_one_flop_count():
    """`--workloads fixed32`: a cell's MFU columns are the step's model FLOPs (lit-rl's count) over each library's
    step time and the measured peak; the table gains them only where a results file has them."""
    compare_trl = _benchmark_module("compare_trl")
    cell = {
        "algorithm": "grpo",
        "model": "20m",
        "workload": "fixed32",
        "setting": "fastest",
        "tflop_per_step": 0.1,
        "peak_tflops": 1.0,
        "lit_rl_mfu": 0.1 / 0.5 / 1.0,
        "trl_mfu": 0.1 / 1.0 / 1.0,
        "lit_rl_s_per_step": 0.5,
        "trl_s_per_step": 1.0,
        "ratio": 0.5,
    }
    table = compare_trl.markdown_table([cell])
    assert (
        "| lit-rl MFU | TRL MFU |" in table
        and "| grpo | 20m | fixed32 | fastest | 0.500 | 1.000 | 0.50 | 20% | 10% |" in table
    )
    assert compare_trl.claims([cell])[-1] == "grpo fastest: ratio 0.50 (target 0.5)"
    plain = {k: cell[k] for k in ("algorithm", "model", "lit_rl_s_per_step", "trl_s_per_step", "ratio")}
    assert "MFU" not in compare_trl.markdown_table([plain | {"rounds": {"lit_rl": [0.5], "trl": [1.0]}}])


def test_every_fixed32_cell_divides_by_the_one_peak_measured_for_the_whole_run(tmp_path, monkeypatch):
    """A run's own 0.05 s probe, taken while it starts up, gave bf16 peaks from 0.68 to 2.47 TFLOP/s across the
    cells of one comparison: the cells use the peak the script measures once, whatever each run's `perf/mfu` said."""
    compare_trl = _benchmark_module("compare_trl")
    assert [compare_trl.compute_dtype(s) for s in ("matched", "bf16", "fastest", "compiled", "defaults")] == [
        "torch.float32",
        *["torch.bfloat16"] * 3,
        None,  # lit-rl fp32, TRL bf16: no one peak
    ]

    def run_child(library, algorithm, model, steps, workdir, work):  # 3 steps of 0.5 s (lit-rl) and 1 s (TRL)
        own_mfu = {"step_s": 0.5, "tflops": 0.2, "mfu": 0.9}  # this run's probe: a peak of 0.22 TFLOP/s
        (workdir / "phases.json").write_text(json.dumps([{**dict.fromkeys(compare_trl.PHASES, 0.1), **own_mfu}] * 3))
        return [0.5] * 3 if library == "lit_rl" else [1.0] * 3

    monkeypatch.setattr(compare_trl, "run_child", run_child)
    args = SimpleNamespace(rounds=1, steps=3, warmup=1)
    cell = compare_trl.compare("grpo", "20m", "model", args, tmp_path, workload="fixed32", peak_tflops=2.0)
    assert cell["peak_tflops"] == 2.0 and cell["tflop_per_step"] == pytest.approx(0.1)
    assert cell["lit_rl_mfu"] == pytest.approx(0.1 / 0.5 / 2.0) and cell["trl_mfu"] == pytest.approx(0.1 / 1.0 / 2.0)
    # Where TRL's step goes: its `generate` calls, timed by the child (here 0.1 s each), beside lit-rl's phases.
    assert cell["trl_generation_s"] == pytest.approx(0.1)
    assert "| TRL s/step | TRL generation_s |" in compare_trl.markdown_table([cell | {"setting": "matched"}])


def test_trl_generation_is_timed_around_the_models_own_generate():
    compare_trl = _benchmark_module("compare_trl")
    model = SimpleNamespace(generate=lambda *args, **kwargs: sum(args) + kwargs["extra"])
    compare_trl.time_generation(model)
    assert model.generate(1, 2, extra=3) == 6 and model.generate(4, extra=0) == 4
    assert len(compare_trl.TRL_GENERATION_S) == 2 and all(s >= 0 for s in compare_trl.TRL_GENERATION_S)
