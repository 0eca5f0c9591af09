"""The README's set-up commands are the ones CI and the configs use."""

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


def test_readme_throughput_table_is_the_committed_results_file():
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("throughput", REPO / "benchmarks" / "throughput.py")
    throughput = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(throughput)
    report = json.loads((REPO / "benchmarks" / "results" / "throughput_cpu.json").read_text())
    assert throughput.markdown_table(report["results"]) in (REPO / "README.md").read_text()
    assert report["command"] in (REPO / "README.md").read_text().replace("\n", " ")
