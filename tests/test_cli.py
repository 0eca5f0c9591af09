"""The `lit-rl` CLI: every config parses, overrides apply, --help documents the constructor arguments."""

import subprocess

import pytest
import yaml

from tests.conftest import CLI_COMMAND, CONFIGS, run_cli

TOP_LEVEL = sorted(CONFIGS.glob("*.yaml"))
OVERLAYS = sorted(p for p in CONFIGS.rglob("*.yaml") if p.parent != CONFIGS)


def _print_config(capsys, *args):
    with pytest.raises(SystemExit) as exit_info:
        run_cli("fit", *args, "--print_config")
    assert exit_info.value.code in (0, None)
    out = capsys.readouterr().out
    # DeepSpeed, once imported, logs "Setting accelerator to CPU" to stdout on machines without a GPU.
    return yaml.safe_load(out[out.index("# lightning.pytorch==") :])


def test_there_are_configs_to_check():
    assert {p.name for p in TOP_LEVEL} >= {"grpo.yaml", "sft.yaml"}


@pytest.mark.parametrize("path", TOP_LEVEL, ids=lambda p: p.name)
def test_every_config_parses_and_starts_with_its_command(capsys, path):
    first_line = path.read_text().splitlines()[0]
    assert first_line == f"# lit-rl fit --config configs/{path.name}"
    config = _print_config(capsys, "--config", str(path))
    assert config["model"]["class_path"].startswith("lit_rl.algorithms.")
    assert config["trainer"]["logger"]["class_path"].endswith("CSVLogger")
    checkpoints = [c for c in config["trainer"]["callbacks"] if c["class_path"].endswith("ModelCheckpoint")]
    assert checkpoints and checkpoints[0]["init_args"]["every_n_train_steps"] > 0
    assert checkpoints[0]["init_args"]["save_top_k"] == -1 and "{step}" in checkpoints[0]["init_args"]["filename"]


@pytest.mark.parametrize("path", OVERLAYS, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_every_overlay_parses_on_top_of_grpo(capsys, path):
    _print_config(capsys, "--config", str(CONFIGS / "grpo.yaml"), "--config", str(path))


def test_dotted_overrides_and_repeated_configs(capsys, tmp_path):
    config = _print_config(
        capsys, "--config", str(CONFIGS / "grpo.yaml"), "--model.beta", "0.04", "--trainer.max_steps", "50"
    )
    assert config["model"]["init_args"]["beta"] == 0.04
    assert config["trainer"]["max_steps"] == 50
    later = tmp_path / "later.yaml"
    later.write_text("model:\n  init_args:\n    num_generations: 4\ntrainer:\n  max_steps: 7\n")
    config = _print_config(capsys, "--config", str(CONFIGS / "grpo.yaml"), "--config", str(later))
    assert config["model"]["init_args"]["num_generations"] == 4 and config["trainer"]["max_steps"] == 7
    assert config["model"]["init_args"]["micro_batch_size"] == 128  # untouched keys keep grpo.yaml's values


def test_help_documents_every_constructor_argument(capsys):
    with pytest.raises(SystemExit):
        run_cli("fit", "--model.help", "lit_rl.algorithms.GRPO")
    text = capsys.readouterr().out
    for option, doc in [
        ("beta", "k3 KL"),
        ("loss_aggregation", "Dr. GRPO"),
        ("scale_rewards", "advantage scaling"),
        ("num_iterations", "passes over each generation"),
        ("epsilon_high", "upper clip range"),
    ]:
        assert f"--model.init_args.{option}" in text or f"--model.{option}" in text, option
        assert doc in text, doc


def test_console_script_lists_subcommands():
    out = subprocess.run([*CLI_COMMAND, "--help"], capture_output=True, text=True, check=True)
    for subcommand in ("fit", "validate", "test", "predict"):
        assert subcommand in out.stdout


def test_unknown_key_is_rejected_by_name(capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_cli("fit", "--config", str(CONFIGS / "grpo.yaml"), "--model.no_such_option", "1", "--print_config")
    assert exit_info.value.code != 0
    assert "no_such_option" in capsys.readouterr().err
