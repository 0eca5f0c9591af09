"""The `lit-rl` CLI: every config parses, overrides apply, --help documents the constructor arguments."""

import re
import stat
import subprocess
import sys

import pytest
import yaml

from tests.conftest import CLI_COMMAND, CONFIGS, run_cli, write_overlay

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
    # Validation lands after whole optimizer steps, and checkpoints after validations: Lightning counts
    # `val_check_interval` in micro-batches, so it must be a multiple of the accumulation.
    trainer = config["trainer"]
    accumulation = trainer.get("accumulate_grad_batches") or 1
    assert trainer["val_check_interval"] % accumulation == 0, trainer["val_check_interval"]
    assert checkpoints[0]["init_args"]["every_n_train_steps"] % (trainer["val_check_interval"] // accumulation) == 0


@pytest.mark.parametrize("path", OVERLAYS, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_every_overlay_parses_on_top_of_grpo(capsys, path):
    _print_config(capsys, "--config", str(CONFIGS / "grpo.yaml"), "--config", str(path))


def test_dotted_overrides_and_repeated_configs(capsys, tmp_path):
    config = _print_config(
        capsys, "--config", str(CONFIGS / "grpo.yaml"), "--model.loss.beta", "0.04", "--trainer.max_steps", "50"
    )
    assert config["model"]["init_args"]["loss"]["beta"] == 0.04
    assert config["trainer"]["max_steps"] == 50
    later = tmp_path / "later.yaml"
    later.write_text("model:\n  init_args:\n    sampling:\n      num_generations: 4\ntrainer:\n  max_steps: 7\n")
    config = _print_config(capsys, "--config", str(CONFIGS / "grpo.yaml"), "--config", str(later))
    sampling = config["model"]["init_args"]["sampling"]
    assert sampling["num_generations"] == 4 and config["trainer"]["max_steps"] == 7
    assert sampling["max_new_tokens"] == 8  # untouched keys of a group keep grpo.yaml's values
    assert config["model"]["init_args"]["schedule"]["micro_batch_size"] == 128
    # An option before a file stands where the file leaves its key alone (one the file sets is refused:
    # test_bad_input's option-before-config); grpo.yaml sets no max_epochs, later.yaml no learning rate.
    config = _print_config(capsys, "--trainer.max_epochs", "3", "--config", str(CONFIGS / "grpo.yaml"))
    assert config["trainer"]["max_epochs"] == 3
    config = _print_config(capsys, "--model", "GRPO", "--config", str(CONFIGS / "grpo.yaml"))  # the same class
    assert config["model"]["class_path"] == "lit_rl.algorithms.GRPO"
    config = _print_config(
        capsys, "--config", str(CONFIGS / "grpo.yaml"), "--model.optim.learning_rate", "0.5", "--config", str(later)
    )
    assert config["model"]["init_args"]["optim"]["learning_rate"] == 0.5


def test_help_documents_every_constructor_argument(capsys):
    with pytest.raises(SystemExit):
        run_cli("fit", "--model.help", "lit_rl.algorithms.GRPO")
    text = capsys.readouterr().out
    for option, doc in [
        ("loss.beta", "k3 KL"),
        ("loss.aggregation", "Dr. GRPO"),
        ("loss.scale_rewards", "advantage scaling"),
        ("schedule.num_iterations", "passes over each generation"),
        ("loss.epsilon_high", "upper clip range"),
        ("loss.objective", "`gspo_token`"),
        ("loss.advantage", "`reinforce_pp_baseline`"),
        ("policy.padding_free", "laid"),
        ("schedule.micro_batch_tokens", "real (prompt + completion) tokens"),
        ("sampling.temperature", "log-probs are computed at this temperature"),
        ("rewards.funcs", "import paths of reward functions"),
        ("env.max_turns", "the most model turns"),
        ("optim.learning_rate", "AdamW learning rate"),
    ]:
        assert f"--model.init_args.{option}" in text or f"--model.{option}" in text, option
        assert doc in " ".join(text.split()), doc  # the help wraps lines


def test_short_algorithm_names_and_negative_numbers_on_the_command_line(capsys):
    config = _print_config(
        capsys, "--config", str(CONFIGS / "rloo.yaml"), "--model", "RLOO", "--model.loss.beta", "-0.5"
    )
    assert config["model"]["class_path"] == "lit_rl.algorithms.RLOO"
    assert config["model"]["init_args"]["loss"]["beta"] == -0.5
    # Over a GRPO config, whose loss group has keys RLOO's has not: one line naming the first.
    with pytest.raises(SystemExit):
        run_cli("fit", "--config", str(CONFIGS / "grpo.yaml"), "--model", "RLOO", "--print_config")
    assert "model.loss.aggregation: unknown option of RLOO's loss group" in capsys.readouterr().err
    config = _print_config(capsys, "--config", str(CONFIGS / "grpo.yaml"), "--model.optim.learning_rate", "-1e-4")
    assert config["model"]["init_args"]["optim"]["learning_rate"] == -1e-4  # parsed (argparse took it for an option)
    with pytest.raises(SystemExit):
        run_cli("fit", "--model.help", "PPO")
    assert "critic_learning_rate" in capsys.readouterr().out  # PPO's own option
    with pytest.raises(SystemExit):
        run_cli("fit", "--help")
    text = " ".join(capsys.readouterr().out.split())
    assert "--model GRPO | PPO | RLOO | OnlineDPO | DPO | SFT" in text and "lit-rl fit --model.help GRPO" in text


@pytest.mark.parametrize("args", [["--model.help"], ["--data.help", "--trainer.max_steps", "2"], ["--model.help="]])
def test_help_without_a_class_names_what_it_needs(capsys, args):
    """jsonargparse prints the base class's empty usage and exits 0 for a `.help` with no class."""
    with pytest.raises(SystemExit) as exit_info:
        run_cli("fit", "--config", str(CONFIGS / "grpo.yaml"), *args)
    assert exit_info.value.code != 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"lit-rl: error: {args[0].rstrip('=')} needs a"), lines
    assert ("--model.help GRPO" if "model" in args[0] else "--data.help PromptDataModule") in lines[0]


def test_every_documented_group_field_is_on_the_command_line(capsys):
    """Each group's fields are options of every algorithm that takes the group, documented once (lit_rl.config)."""
    import dataclasses
    import inspect

    import lit_rl.algorithms
    from lit_rl.config import GROUP_NAMES

    for name in ("GRPO", "PPO", "RLOO", "OnlineDPO", "DPO", "SFT"):
        with pytest.raises(SystemExit):
            run_cli("fit", "--model.help", name)
        text = capsys.readouterr().out
        parameters = inspect.signature(getattr(lit_rl.algorithms, name).__init__).parameters
        for group in (g for g in GROUP_NAMES if g in parameters):
            for field in dataclasses.fields(type(parameters[group].default)):  # the loss group: the algorithm's
                assert f"--model.{group}.{field.name} " in text, (name, group, field.name)


@pytest.mark.parametrize("given", ["command line", "config file"])
def test_a_key_of_lit_rl_0_1_fails_in_one_line_naming_its_new_place(capsys, tmp_path, given):
    old = ["--model.temperature", "0.7"]
    if given == "config file":
        (tmp_path / "old.yaml").write_text("model:\n  init_args:\n    temperature: 0.7\n")
        old = ["--config", str(tmp_path / "old.yaml")]
    with pytest.raises(SystemExit) as exit_info:
        run_cli("fit", "--config", str(CONFIGS / "grpo.yaml"), *old, "--print_config")
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("lit-rl: error: model.temperature: moved to model.sampling.temperature"), line


def test_no_shipped_config_sets_a_key_twice_and_yaml_merges_are_not_duplicates():
    """`--config` files are refused when a mapping sets a key twice (YAML keeps the last silently); the shipped ones
    must pass, and a `<<` merge that a mapping overrides is no duplicate."""
    from lit_rl.cli import duplicate_key_problem

    assert [p for p in CONFIGS.rglob("*.yaml") if duplicate_key_problem(str(p), p.read_text())] == []
    assert duplicate_key_problem("m.yaml", "base: &b\n  x: 1\nother:\n  <<: *b\n  x: 3\n") is None
    assert duplicate_key_problem("m.yaml", "a: [{x: 1}, {x: 2}]\nb: {x: 1}\n") is None
    twice = duplicate_key_problem("m.yaml", "a:\n  x: 1\n  y: 2\n  x: 3\n")
    assert twice == "m.yaml line 4: key 'x' appears twice in one mapping (also on line 2; the first would be dropped)"
    assert duplicate_key_problem("m.yaml", "a: [1\n") is None  # no YAML: the parser's error names it


def test_an_unloadable_config_file_is_named_with_its_line_before_the_subcommand_too(capsys, tmp_path):
    """jsonargparse's "Problems parsing config" named neither the file nor the line, and a top-level `--config`
    (before `fit`) is read by another parser than the subcommand's."""
    (tmp_path / "tab.yaml").write_text("fit:\n  trainer:\n\tmax_steps: 1\n")
    with pytest.raises(SystemExit) as exit_info:
        run_cli("--config", str(tmp_path / "tab.yaml"), "fit", "--config", str(CONFIGS / "grpo.yaml"), "--print_config")
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"lit-rl: error: {tmp_path / 'tab.yaml'} line 3, column 1: found character"), line


def test_renamed_key_hint_names_a_group_field_the_algorithm_has():
    from lit_rl.algorithms import DPO, GRPO, PPO, SFT
    from lit_rl.config import renamed_key_hint

    assert renamed_key_hint("model.loss.loss_type", DPO) == "model.loss.type"
    assert renamed_key_hint("model.loss.loss_type", GRPO) == "model.loss.aggregation"  # TRL's GRPO loss_type
    assert renamed_key_hint("model.init_args.rewards.reward_weights", GRPO) == "model.rewards.weights"
    assert renamed_key_hint("model.loss.whiten_advantages", PPO) == "model.loss.normalize_advantages"
    assert renamed_key_hint("model.loss.whiten_advantages", GRPO) is None  # GRPO's loss has no such field
    assert renamed_key_hint("model.rewards.reward_funcs", SFT) is None and renamed_key_hint("model.loss_type") is None


def test_null_clears_an_option_inside_a_group(capsys):
    config = _print_config(
        capsys, "--config", str(CONFIGS / "grpo.yaml"), "--model.rewards.weights", "null", "--model.policy.lora", "null"
    )
    assert config["model"]["init_args"]["rewards"]["weights"] is None
    assert config["model"]["init_args"]["policy"]["lora"] is None


def test_normalize_args_touches_only_short_names_and_negative_values():
    from lit_rl.cli import normalize_args

    assert normalize_args(["fit", "--model", "GRPO", "--data.help", "SFTDataModule", "--x", "-3", "--y=-2"]) == [
        "fit", "--model", "lit_rl.algorithms.GRPO", "--data.help", "lit_rl.data.SFTDataModule", "--x=-3", "--y=-2"
    ]  # fmt: skip
    unchanged = ["fit", "--config", "GRPO", "--model.rewards.funcs", "[a.b]", "--print_config", "-c", "x.yaml"]
    assert normalize_args(unchanged) == unchanged


def test_console_script_lists_the_subcommands_lit_rl_can_run():
    """`fit` and `validate`; Lightning's `test` and `predict` need hooks and loaders no lit-rl algorithm has: they
    are not offered (listed, they failed with Lightning's `No test_step() method defined`)."""
    out = subprocess.run([*CLI_COMMAND, "--help"], capture_output=True, text=True, check=True)
    assert "{fit,validate}" in out.stdout
    refused = subprocess.run(
        [*CLI_COMMAND, "test", "--config", str(CONFIGS / "grpo.yaml")], capture_output=True, text=True
    )
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    (line,) = refused.stderr.strip().splitlines()
    assert "'test'" in line and "fit" in line and "validate" in line, line


def test_unknown_key_is_rejected_by_name(capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_cli("fit", "--config", str(CONFIGS / "grpo.yaml"), "--model.no_such_option", "1", "--print_config")
    assert exit_info.value.code != 0
    assert "no_such_option" in capsys.readouterr().err


# --- The console: a summary at the end of `fit`, and none of the messages a user cannot act on ---------------------

# What a normal run printed before `lit_rl.cli.quiet_console`: Lightning's advertisement, Lightning's use of a
# deprecated torch API, DataLoader advice, the frozen reference model in eval mode, DeepSpeed finding no GPU.
SILENCED = (
    "litlogger",
    "💡 Tip",
    "LeafSpec",
    "does not have many workers",
    "Your `IterableDataset` has `__len__` defined",
    "module(s) in eval mode",
    "Setting accelerator to CPU",
)


def _last_values(log_dir):
    """The last non-empty value of every column of metrics.csv."""
    from tests.conftest import read_metrics

    last = {}
    for row in read_metrics(log_dir):
        last.update({key: float(value) for key, value in row.items() if value != ""})
    return last


def test_headline_metrics_are_a_small_set_per_algorithm():
    from lit_rl.callbacks import headline_metrics

    grpo = ["loss", "reward", "reward_std", "rewards/correctness", "rewards/integer_format", "kl", "entropy"]
    assert headline_metrics(grpo) == ["reward", "rewards/correctness", "rewards/integer_format"]
    online_dpo = ["loss", "reward", "rewards/judge", "rewards/chosen", "rewards/accuracies", "rewards/margins"]
    assert headline_metrics(online_dpo) == ["reward", "rewards/judge"]
    dpo = ["loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen"]
    assert headline_metrics(dpo) == ["loss", "rewards/accuracies"]
    assert headline_metrics(["loss", "token_accuracy", "num_tokens"]) == ["loss"]


def test_fit_ends_with_a_summary_of_steps_metrics_and_outputs(tmp_path, capsys):
    from tests.conftest import FAST_GRPO, write_overlay

    overlay = write_overlay(tmp_path / "o.yaml", every_n_train_steps=2, save_dir=tmp_path / "runs")
    config = yaml.safe_load(overlay.read_text())
    config["trainer"]["callbacks"].append({"class_path": "lit_rl.callbacks.SaveHFPretrained"})
    overlay.write_text(yaml.safe_dump(config))
    run_cli(
        "fit",
        "--config",
        str(CONFIGS / "grpo.yaml"),
        "--config",
        str(overlay),
        *FAST_GRPO,
        "--trainer.max_steps",
        "3",
        "--trainer.val_check_interval",
        "2",
    )
    log_dir = tmp_path / "runs" / "run" / "version_0"
    lines = capsys.readouterr().out.strip().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("lit-rl: "))
    header, train, val, speed, *outputs = lines[start:]
    assert header.startswith("lit-rl: done, 3 optimizer steps in 0:00:"), header
    assert re.fullmatch(r"  speed +[\d.]+ s/step, [\d.e-]+ TFLOP/s, MFU [\d.e-]+% \(of measured cpu matmul.*\)", speed)
    last = _last_values(log_dir)
    for line, keys in (
        (train, ["train/reward", "train/rewards/correctness", "train/rewards/integer_format"]),
        (val, ["val/reward", "val/rewards/correctness", "val/rewards/integer_format"]),
    ):
        assert line.split()[::2] == keys, line  # the headline set, nothing else (no loss, no kl)
        for key, shown in zip(keys, line.split()[1::2]):
            assert float(shown) == pytest.approx(last[key], rel=1e-3, abs=1e-4), key
    assert [line.split() for line in outputs] == [
        ["checkpoint", str(log_dir / "checkpoints" / "step=2.ckpt"), "(step", "2)"],  # the run ended at step 3
        ["metrics", str(log_dir / "metrics.csv")],
        ["model", str(log_dir / "hf")],
    ]
    assert (log_dir / "hf" / "config.json").is_file()


def test_a_normal_fit_prints_no_advert_and_no_known_warning(tmp_path):
    """The real process and console (progress bar on), the shipped config as it is (its checkpoint callback, with
    the `last.ckpt` link, and the Hugging Face export, which imports DeepSpeed), GRPO with a frozen reference model
    (beta > 0) and validation, run in a scratch folder (`runs/` lands there); the CPU count is raised to 16 so that
    Lightning's "does not have many workers" check fires on a small machine too."""
    from tests.conftest import FAST_GRPO, cli_env

    driver = (
        "import lightning.fabric.utilities.data as data; data._num_cpus_available = lambda: 16; "
        "from lit_rl.cli import main; main()"
    )
    args = ["--config", str(CONFIGS / "grpo.yaml"), *FAST_GRPO, "--trainer.enable_progress_bar", "true"]
    args += ["--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--model.loss.beta", "0.04"]
    result = subprocess.run(
        [sys.executable, "-c", driver, "fit", *args],
        cwd=tmp_path,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    console = result.stdout + result.stderr
    for text in SILENCED:
        assert text not in console, (text, console[-3000:])
    lines = result.stdout.strip().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("lit-rl: "))
    assert lines[header].startswith("lit-rl: done, 2 optimizer steps in"), lines[header]
    assert all(line.startswith("  ") for line in lines[header + 1 :]), lines  # the summary comes last, after the bar
    # The shipped callback wrote `last.ckpt`: a file, as checkpoints.md says of a run that ends before its first
    # step checkpoint (every 100 steps), since there is none to link to.
    checkpoints = tmp_path / "runs" / "grpo" / "version_0" / "checkpoints"
    assert [p.name for p in checkpoints.iterdir()] == ["last.ckpt"] and not (checkpoints / "last.ckpt").is_symlink()
    # What the run wrote is its user's alone (docs/security.md): folders 0700, files 0600.
    written = [tmp_path / "runs", *(tmp_path / "runs").rglob("*")]
    modes = {path.relative_to(tmp_path).as_posix(): stat.S_IMODE(path.stat().st_mode) for path in written}
    assert {"runs/grpo/version_0/metrics.csv", "runs/grpo/version_0/hf/config.json"} <= set(modes)
    assert all(mode == (0o700 if (tmp_path / name).is_dir() else 0o600) for name, mode in modes.items()), modes


def test_lit_rl_umask_shares_a_runs_files_with_the_group_and_a_bad_value_is_one_line(tmp_path):
    """`LIT_RL_UMASK=027`, as docs/security.md tells a team: folders 0750, files 0640; a value that is not an octal
    umask, or one that lets others write, stops `lit-rl` in one line naming the variable, before anything runs."""
    from tests.conftest import cli_env

    write = (
        "from lit_rl.entry import private_files; private_files(); import os; "
        "os.mkdir('folder'); open('folder/file', 'w').close()"
    )
    env = {**cli_env(), "LIT_RL_UMASK": "027"}
    subprocess.run([sys.executable, "-c", write], cwd=tmp_path, env=env, check=True, timeout=60)
    assert stat.S_IMODE((tmp_path / "folder").stat().st_mode) == 0o750
    assert stat.S_IMODE((tmp_path / "folder" / "file").stat().st_mode) == 0o640
    entry = "import sys; from lit_rl.entry import main; sys.argv = ['lit-rl', 'fit']; main()"
    for bad in ("0o9", "002"):  # not octal; lets the group write into the run's weights
        env["LIT_RL_UMASK"] = bad
        result = subprocess.run([sys.executable, "-c", entry], env=env, capture_output=True, text=True, timeout=60)
        assert result.returncode == 1
        assert result.stderr == (
            f"lit-rl: error: LIT_RL_UMASK={bad!r} is not an octal umask that keeps a run's files from being written "
            "by others, such as 077, 027 or 022\n"
        )


def test_ppo_help_documents_its_critic_options(capsys):
    with pytest.raises(SystemExit):
        run_cli("fit", "--model.help", "lit_rl.algorithms.PPO")
    text = capsys.readouterr().out
    for option, doc in [
        ("loss.gamma", "GAE discount"),
        ("loss.lam", "GAE lambda"),
        ("loss.value_clip", "sampling-time values"),
        ("critic_learning_rate", "AdamW learning rate of the critic"),
        ("critic_model_name_or_path", "an exported critic"),
    ]:
        assert f"--model.init_args.{option}" in text or f"--model.{option}" in text, option
        assert doc in " ".join(text.split()), doc  # the help wraps lines


@pytest.mark.parametrize("algorithm", ["RLOO", "PPO", "OnlineDPO", "DPO", "SFT"])
def test_switching_algorithms_over_the_grpo_config_stops_in_one_line_naming_the_config_to_start_from(
    tmp_path, capsys, algorithm
):
    """`--model X` over `configs/grpo.yaml` (what a reader tries after the getting-started page): one line naming
    what X does not take and X's own config, never a traceback. SFT takes every key of grpo.yaml's groups, so its
    line comes when the run starts, from the data module (exit 1, not the parser's 2)."""
    from lit_rl.cli import SHIPPED_CONFIGS

    overlay = write_overlay(tmp_path / "overlay.yaml", save_dir=tmp_path / "runs")
    with pytest.raises(SystemExit) as stop:
        run_cli(
            "fit",
            "--config",
            str(CONFIGS / "grpo.yaml"),
            "--config",
            str(overlay),
            "--model",
            algorithm,
            "--trainer.max_steps",
            "1",
        )
    assert stop.value.code == (1 if algorithm == "SFT" else 2)
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line.startswith("lit-rl")]
    assert len(lines) == 1 and lines[0].startswith("lit-rl: error: "), lines
    assert f"start from {SHIPPED_CONFIGS[algorithm]}" in lines[0] and "Traceback" not in err


def test_a_fit_without_validation_data_warns_nothing_about_its_empty_validation(tmp_path):
    """`--data.val_data null` (the README's and "Coming from TRL"'s command) validates nothing on purpose: Lightning's
    "Total length of `list` across ranks is zero" is not shown."""
    from tests.conftest import FAST_GRPO, cli_env, write_overlay

    overlay = write_overlay(tmp_path / "o.yaml", save_dir=tmp_path / "runs")
    args = ["--config", str(CONFIGS / "grpo.yaml"), "--config", str(overlay), *FAST_GRPO, "--data.val_data", "null"]
    result = subprocess.run(
        ["lit-rl", "fit", *args, "--trainer.max_steps", "1", "--trainer.val_check_interval", "1"],
        cwd=tmp_path,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "lit-rl: done, 1 optimizer step" in result.stdout
    assert "across ranks is zero" not in result.stdout + result.stderr


def test_seed_everything_changes_what_a_run_samples(tmp_path):
    """`--seed_everything N`, as a user runs several seeds: the same seed samples the same completions (the same
    rewards), another seed other ones. Every seed sampled alike before (`global_batch_seeds`)."""
    from tests.conftest import FAST_GRPO, read_metrics, write_overlay

    def rewards(seed: int, name: str) -> list[str]:
        overlay = write_overlay(tmp_path / f"{name}.yaml", every_n_train_steps=None, save_dir=tmp_path / name)
        options = [*FAST_GRPO, "--trainer.max_steps", "2", "--trainer.limit_val_batches", "0"]
        config = ["--config", str(CONFIGS / "grpo.yaml"), "--config", str(overlay)]
        run_cli("fit", *config, *options, "--seed_everything", str(seed))
        rows = read_metrics(tmp_path / name / "run" / "version_0")
        return [row["train/reward"] for row in rows if row["train/reward"]]

    first = rewards(1, "first")
    assert len(first) == 2 and rewards(1, "again") == first
    assert rewards(2, "other") != first


def test_the_export_callback_refuses_a_module_that_is_not_a_lit_rl_algorithm_before_training():
    """SaveHFPretrained saves `policy` and `tokenizer`, which only a lit-rl algorithm declares: another module is
    refused at setup, in one line naming the callback and the class, not after a whole run."""
    import lightning as L

    from lit_rl.callbacks import SaveHFPretrained
    from lit_rl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"SaveHFPretrained exports .*; BoringModel is not one"):
        SaveHFPretrained().setup(None, type("BoringModel", (L.LightningModule,), {})(), "fit")
