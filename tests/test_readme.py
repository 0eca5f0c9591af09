"""The README's set-up commands are the ones CI and the configs use; the tables and numbers of the README and the docs
pages are the committed results, and every committed result says which commit made it, from a clean tree, with a
script that commit has."""

import importlib.util
import json
import shlex
import subprocess
import sys

import pytest

from tests.conftest import REPO

RESULTS = REPO / "benchmarks" / "results"


def _documentation() -> str:
    """The README and every docs page, one after the other: where a table or a number may be quoted."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    return "\n\n".join(page.read_text() for page in pages)


def _setup_commands() -> list[str]:
    lines = (REPO / "README.md").read_text().splitlines()
    start = lines.index("## Set up and run")
    block = lines[lines.index("```bash", start) + 1 : lines.index("```", lines.index("```bash", start) + 1)]
    return [line for line in block if line and not line.startswith("#")]


def _benchmark_module(script: str):
    spec = importlib.util.spec_from_file_location(script, REPO / "benchmarks" / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[script] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_ci_runs_the_readme_test_command_verbatim():
    run_command, test_command = _setup_commands()
    assert test_command.startswith('pip install -e ".[test-cpu]"') and test_command.endswith("pytest")
    ci_lines = (REPO / ".ci" / "run").read_text().splitlines()
    assert test_command in ci_lines


def test_readme_main_job_is_the_grpo_config():
    run_command, _ = _setup_commands()
    assert run_command == "pip install -e . && lit-rl fit --config configs/grpo.yaml"


@pytest.mark.parametrize(
    "script, files",
    [
        ("throughput", ["throughput_cpu.json"]),
        ("throughput", ["throughput_strategies_cpu.json"]),
        ("throughput", ["async_cpu.json"]),
        ("async_accuracy", ["async_accuracy_cpu.json"]),
        ("packing", ["packing_cpu.json"]),
        ("generation", ["generation_cpu.json"]),
        ("compare_trl", ["compare_trl_variable_cpu.json"]),
        ("long_completions", ["long_completions_cpu.json"]),
        ("lora", ["lora_cpu.json"]),
        ("compare_trl", ["compare_trl_cpu.json"]),
        ("weight_push", ["weight_push_cpu.json"]),
        ("push_memory", ["push_memory_cpu.json"]),
        ("logprob_memory", ["logprob_memory_cpu.json"]),
        ("run_report", ["grpo_demo.json"]),
        ("run_report", ["dpo_demo.json"]),
        ("run_report", ["rloo_demo.json", "online_dpo_demo.json"]),
        ("run_report", ["ppo_demo.json"]),
        ("run_report", ["grpo_tools_demo.json"]),
        ("run_report", ["grpo_reasoning_gym_demo.json"]),
        ("soak", ["soak_cpu.json"]),
        ("ci_time", ["ci_time.json"]),
        ("ci_history", ["ci_history.json"]),
        ("scaling_model", ["scaling_cpu.json"]),
        ("weight_transport", ["weight_transport_cpu.json"]),
        ("gpu_suite", ["gpu_nvidia-h200.json"]),
        ("gpu_suite", ["gpu_nvidia-h200_hf_compiled.json"]),
        ("gpu_suite", ["gpu_nvidia-h200_mfu.json"]),
        ("gpu_suite", ["gpu_nvidia-h200_zero3.json"]),
        ("precision", ["precision_cpu.json"]),
        ("compiled_decoding", ["compiled_decoding_cpu.json"]),
        ("packed_linear", ["packed_linear_cpu.json"]),
        ("compare_trl", ["compare_trl_fixed32_cpu.json"]),
        ("train_mfu", ["train_mfu_cpu.json"]),
        ("agentic", ["agentic_cpu.json"]),
        ("tools_accuracy", ["tools_accuracy_cpu.json"]),
        ("ready_batches", ["ready_batches_cpu.json"]),
        ("ready_batches", ["colocated_episodes_cpu.json"]),
    ],
)
def test_documented_tables_and_numbers_are_the_committed_results_files(script, files):
    """Each table is its script's `markdown_table` of the committed JSON (several files: one table), each prose number
    its `claims`, and the command that wrote each file is quoted (line breaks aside), in the README or a docs page."""
    module = _benchmark_module(script)
    reports = [json.loads((RESULTS / name).read_text()) for name in files]
    readme = _documentation()
    flat = " ".join(readme.split())
    if hasattr(module, "markdown_table"):
        results = [r["results"] for r in reports]
        assert module.markdown_table(results[0] if len(results) == 1 else results) in readme
    for report in reports:
        for claim in getattr(module, "claims", lambda results: [])(report["results"]):
            assert claim in flat, claim
        assert report["command"] in flat


def test_every_results_file_is_quoted_by_the_readme_test():
    quoted = {"throughput_cpu.json", "throughput_strategies_cpu.json", "lora_cpu.json", "compare_trl_cpu.json"}
    quoted |= {"weight_push_cpu.json", "push_memory_cpu.json", "logprob_memory_cpu.json", "ci_time.json"}
    quoted |= {"ci_history.json"}
    quoted |= {"soak_cpu.json", "async_cpu.json", "async_accuracy_cpu.json", "packing_cpu.json"}
    quoted |= {"generation_cpu.json", "compare_trl_variable_cpu.json", "long_completions_cpu.json"}
    quoted |= {"scaling_cpu.json", "weight_transport_cpu.json", "gpu_nvidia-h200.json", "precision_cpu.json"}
    quoted |= {"compiled_decoding_cpu.json", "compare_trl_fixed32_cpu.json", "gpu_nvidia-h200_hf_compiled.json"}
    quoted |= {"train_mfu_cpu.json", "gpu_nvidia-h200_mfu.json", "packed_linear_cpu.json", "gpu_nvidia-h200_zero3.json"}
    quoted |= {"agentic_cpu.json", "tools_accuracy_cpu.json", "ready_batches_cpu.json", "colocated_episodes_cpu.json"}
    demos = ("grpo", "dpo", "rloo", "online_dpo", "ppo", "grpo_tools", "grpo_reasoning_gym")
    quoted |= {f"{demo}_demo.json" for demo in demos}
    assert {path.name for path in RESULTS.glob("*.json")} == quoted


def _script_of(command: str) -> str:
    """The file a results command ran: its first argument with a path in it (`benchmarks/x.py`, `.ci/run`)."""
    return next(token for token in shlex.split(command) if "/" in token)


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.json")), ids=lambda path: path.name)
def test_committed_results_record_a_clean_commit_that_has_their_script(path):
    report = json.loads(path.read_text())
    assert set(report) >= {"commit", "dirty", "command"}, "results without provenance"
    # Dirty only where its source tree is a commit's (a lent GPU machine's `.git` can lag the files it runs).
    assert report["dirty"] is False or "tree" in report, f"{path.name} was written from a dirty tree"
    if _git("rev-parse", "--is-inside-work-tree").stdout.strip() != "true":
        pytest.skip("not a git checkout")
    if _git("rev-parse", "--is-shallow-repository").stdout.strip() == "true":
        pytest.skip("a shallow clone: the recorded commits may be missing")
    commit = report["commit"]
    if report["dirty"]:
        provenance = _benchmark_module("provenance")
        commits = _git("rev-list", "HEAD").stdout.split()
        commit = next((c for c in commits if provenance.source_tree(REPO, c) == report["tree"]), None)
        assert commit, f"{path.name} was written from a dirty tree that is no commit's (tree {report['tree']})"
    script = _script_of(report["command"])
    assert not script.startswith("/"), f"{path.name}: the command names an absolute path: {script}"
    found = _git("cat-file", "-e", f"{commit}:{script}")
    assert found.returncode == 0, f"{path.name}: {script} does not exist at its recorded commit {commit}"
