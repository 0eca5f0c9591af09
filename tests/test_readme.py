"""The README's set-up commands are the ones CI and the configs use; its tables are the committed results."""

import pytest

from tests.conftest import REPO


def _setup_commands() -> list[str]:
    lines = (REPO / "README.md").read_text().splitlines()
    start = lines.index("## Set up and run")
    block = lines[lines.index("```bash", start) + 1 : lines.index("```", lines.index("```bash", start) + 1)]
    return [line for line in block if line and not line.startswith("#")]


def test_ci_runs_the_readme_test_command_verbatim():
    run_command, test_command = _setup_commands()
    assert test_command.startswith('pip install -e ".[test]"') and test_command.endswith("pytest")
    ci_lines = (REPO / ".ci" / "run").read_text().splitlines()
    assert test_command in ci_lines


def test_readme_main_job_is_the_grpo_config():
    run_command, _ = _setup_commands()
    assert run_command == "pip install -e . && lit-rl fit --config configs/grpo.yaml"


@pytest.mark.parametrize(
    "script, results",
    [
        ("throughput", "throughput_cpu.json"),
        ("throughput", "throughput_strategies_cpu.json"),
        ("lora", "lora_cpu.json"),
        ("compare_trl", "compare_trl_cpu.json"),
        ("weight_push", "weight_push_cpu.json"),
        ("push_memory", "push_memory_cpu.json"),
    ],
)
def test_readme_tables_are_the_committed_results_files(script, results):
    import importlib.util
    import json
    import sys

    spec = importlib.util.spec_from_file_location(script, REPO / "benchmarks" / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[script] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    report = json.loads((REPO / "benchmarks" / "results" / results).read_text())
    assert module.markdown_table(report["results"]) in (REPO / "README.md").read_text()
    assert report["command"] in (REPO / "README.md").read_text().replace("\n", " ")
