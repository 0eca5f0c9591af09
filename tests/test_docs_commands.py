"""The docs are executable: every shell command and YAML block of README.md and docs/*.md runs or parses as printed,
so a renamed key, flag, extra or script fails here instead of in a reader's terminal. By one rule per kind:

- `lit-rl fit` / `lit-rl validate`: parsed by the CLI in this process with `--print_config` appended (nothing is
  loaded or trained, so hub ids and the reader's data files may stay as printed); `--model.help` and `--data.help`
  run as printed. A `--config` file not in the repository is the reader's own (`my_overrides.yaml`): an empty one
  stands in for it. `...` stands for the page's full command before it (`ELLIPSIS`).
- Then they run, a page's commands in the page's order in one folder, as a reader runs them
  (`test_a_pages_commands_run_in_order_as_a_reader_runs_them`), changed by one rule: shortened to one optimizer step
  and one validation batch (`SHORTER`), with `tests/docs_reader/`'s files beside them (the prompts, reward
  functions, environment and overrides the commands name; a file the page prints, `# my_tools.py, beside the run`,
  from the page), and a model a reader downloads (a hub id, `/path/to/a/hf/model`) replaced by a random tiny model
  with the chat template its family released (`STAND_INS`). Commands this machine cannot run (GPUs, several
  processes or machines, vLLM, OpenEnv) are parsed only, each for a reason that names the test running its path
  (`NOT_RUN_HERE`); a command another page printed word for word runs once.
- `pip install -e ".[extras]"`: every extra is one of pyproject.toml's.
- `python benchmarks/x.py --flag` and `python -m package.module --flag`: the script or module exists and, when it
  is this repository's, takes every flag the command gives it (its source names the flag).
- YAML blocks parse; one with a `model:` or `trainer:` key is parsed as an overlay on `configs/grpo.yaml`.
- Not run: `pytest`, `pip uninstall`, `cp`, `export`, and synopsis lines (`[--option]` in brackets).
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import shutil
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, run_cli

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# What `...` stands for in a page's commands: the page's own full command before it.
ELLIPSIS = {
    "rollouts.md": ["--config", "configs/grpo.yaml", "--config", "configs/rollout/vllm_server.yaml"],
}
NOT_RUN = {"pytest", "cp", "export"}


def _blocks(page: Path, languages: tuple[str, ...]) -> list[str]:
    """The fenced blocks of `page` in one of `languages`, continuation lines joined."""
    pattern = re.compile(r"^[ \t]*```(\w*)\n(.*?)^[ \t]*```", re.S | re.M)
    return [m.group(2).replace("\\\n", " ") for m in pattern.finditer(page.read_text()) if m.group(1) in languages]


def _commands() -> list[tuple[str, list[str]]]:
    """Every command of every shell block: (page name, its words), `&&` chains split, variable assignments dropped."""
    commands = []
    for page in PAGES:
        for block in _blocks(page, ("bash", "sh", "shell")):
            for line in block.splitlines():
                if not line.strip() or "[--" in line:  # a synopsis, not a command
                    continue
                words = shlex.split(line, comments=True)
                command: list[str] = []
                for word in [*words, "&&"]:
                    if word != "&&":
                        command.append(word)
                        continue
                    while command and re.match(r"^[A-Z_][A-Z0-9_]*=", command[0]):
                        command.pop(0)  # VLLM_SERVER_DEV_MODE=1 python ...
                    if command:
                        commands.append((page.name, command))
                    command = []
    return commands


COMMANDS = _commands()
LIT_RL = [(page, words) for page, words in COMMANDS if words[0] == "lit-rl" and words[1] in ("fit", "validate")]
PYTHON = [(page, words) for page, words in COMMANDS if words[0] == "python" and words[1] != "-c"]
PIP = [(page, words) for page, words in COMMANDS if words[:3] == ["pip", "install", "-e"]]


def _id(item: tuple[str, list[str]]) -> str:
    page, words = item
    return f"{page}:{' '.join(words)[:80]}"


def test_every_command_of_the_docs_is_checked_by_a_rule():
    kinds = {"lit-rl", "python", "pip", *NOT_RUN}
    unchecked = [_id(item) for item in COMMANDS if item[1][0] not in kinds]
    assert not unchecked, unchecked
    assert len(LIT_RL) >= 30 and len(PYTHON) >= 5 and len(PIP) >= 5  # the extraction finds the pages' commands


def _expanded(page: str, words: list[str]) -> list[str]:
    """A command's arguments after `lit-rl fit`, `...` replaced by what it stands for on `page`."""
    args: list[str] = []
    for word in words[2:]:
        args.extend(ELLIPSIS[page] if word == "..." else [word])
    return args


@pytest.mark.parametrize("item", LIT_RL, ids=_id)
def test_lit_rl_commands_parse_as_printed(item, tmp_path, monkeypatch, capsys):
    page, words = item
    monkeypatch.chdir(REPO)  # the docs' paths are the repository's (configs/...)
    args = _expanded(page, words)
    for i, word in enumerate(args[:-1]):
        if word == "--config" and not (REPO / args[i + 1]).exists():  # the reader's own file
            (tmp_path / "reader.yaml").write_text("{}\n")
            args[i + 1] = str(tmp_path / "reader.yaml")
    printed = any(word.endswith(".help") or word == "--print_config" for word in args)
    with pytest.raises(SystemExit) as ended:
        run_cli(words[1], *args, *([] if printed else ["--print_config"]))
    assert ended.value.code in (0, None), capsys.readouterr().err[-2000:]
    assert capsys.readouterr().out.strip()


@pytest.mark.parametrize("item", PYTHON, ids=_id)
def test_python_commands_name_scripts_and_flags_that_exist(item):
    _, words = item
    if words[1] == "-m":
        spec = importlib.util.find_spec(words[2])
        assert spec is not None and spec.origin, f"no module {words[2]}"
        if not Path(spec.origin).is_relative_to(REPO):
            return  # another package's (vLLM's server): its flags are its own
        source, flags = Path(spec.origin).read_text(), words[3:]
    else:
        script = REPO / words[1]
        assert script.is_file(), f"no script {words[1]}"
        source, flags = script.read_text(), words[2:]
        # Options a script takes from a helper beside it (`provenance.parse_report_args`): the helper's source too.
        for helper in re.findall(r"^\s*from (\w+) import", source, re.M):
            if (script.parent / f"{helper}.py").is_file():
                source += (script.parent / f"{helper}.py").read_text()
    for flag in flags:
        if flag.startswith("--"):
            name = flag.split("=")[0]
            assert f'"{name}"' in source or f"'{name}'" in source, f"{words[1]} takes no {name}"


@pytest.mark.parametrize("item", PIP, ids=_id)
def test_pip_extras_exist(item):
    _, words = item
    section = (REPO / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1].split("\n[")[0]
    extras = set(re.findall(r"^([\w-]+) = \[", section, re.M))  # (tomllib is Python 3.11's)
    target = words[3]
    asked = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", target)
    assert asked, f"pip install -e {target}: not this repository"
    missing = set((asked.group(1) or "").split(",")) - extras - {""}
    assert not missing, f"pip install -e {target}: no extra {sorted(missing)}"


YAML_BLOCKS = [(page.name, block) for page in PAGES for block in _blocks(page, ("yaml", "yml"))]


@pytest.mark.parametrize("item", YAML_BLOCKS, ids=lambda item: item[0])
def test_yaml_blocks_parse_and_configs_among_them_are_taken_by_the_cli(item, tmp_path, monkeypatch, capsys):
    _, block = item
    document = yaml.safe_load(textwrap.dedent(block))
    if not isinstance(document, dict) or not {"model", "trainer", "data"} & set(document):
        return
    overlay = tmp_path / "snippet.yaml"
    overlay.write_text(textwrap.dedent(block))
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as ended:
        run_cli("fit", "--config", "configs/grpo.yaml", "--config", str(overlay), "--print_config")
    assert ended.value.code in (0, None), capsys.readouterr().err[-2000:]


# What a run of a docs command is shortened by: the step and validation batch counts, nothing else.
SHORTER = ["--trainer.max_steps", "1", "--trainer.limit_val_batches", "1"]
READER_FILES = REPO / "tests" / "docs_reader"
# The commands parsed only (above), by what they need that this machine lacks, and where that path runs.
NOT_RUN_HERE = {
    "_8gpu.yaml": "8 GPUs, which no lent machine has had: never run (8 CPU processes of ZeRO-3 in test_deepspeed)",
    "configs/strategy/": "several trainer processes (tests/test_rank_invariance.py, tests/test_strategy_devices.py)",
    "configs/rollout/vllm_": "a vLLM engine or server (tests/integration/test_vllm.py starts them as the docs do)",
    "lit_rl.envs.OpenEnv": "openenv, which cannot be installed beside vLLM (tests/test_openenv.py)",
    "Qwen/Qwen3.5-": "Qwen3.5's tool instructions on a byte-level stand-in (tests/test_chat_tools.py's Qwen3.5 run)",
}


def _stand_in_model(word: str, folder: Path) -> str:
    """The model a reader would download (`word`), as a random tiny model with its family's released chat template;
    `word` itself when it is no download."""
    from tests.qwen_chat import save_qwen_chat_model

    if word.startswith("Qwen/Qwen2.5-"):  # Qwen2.5-Instruct's template, tools and all
        path = folder / "stand-in-qwen2.5"
        return str(path if path.exists() else save_qwen_chat_model(path))
    if word == "/path/to/a/hf/model":  # a folder of the reader's: the shipped warm start's
        return str(REPO / "lit_rl" / "assets" / "tiny-qwen2-addition-sft")
    return word


def _page_files(page: Path) -> dict[str, str]:
    """The files a page prints (a python block opening with `# my_tools.py, beside the run`): name -> text."""
    files = {}
    for block in _blocks(page, ("python",)):
        named = re.match(r"# (\w+\.py), beside the run\n", block)
        if named:
            files[named.group(1)] = block
    return files


def _runs(words: list[str], page: str) -> bool:
    """Whether the run test runs this command (else it is printed only, or needs what `NOT_RUN_HERE` names)."""
    args = _expanded(page, words)
    printed = any(word.endswith(".help") or word == "--print_config" for word in args)
    return not printed and not any(needs in " ".join(args) for needs in NOT_RUN_HERE)


RUN_PAGES = sorted({page for page, words in LIT_RL if _runs(words, page)})
_ALREADY_RUN: dict[tuple[str, ...], str] = {}  # a command's words -> the page that ran it


def _saved_step(log_dir: Path) -> int:
    """The optimizer step of a run's last checkpoint (`checkpoints/last.ckpt`; -1 for a run without one, such as a
    `validate`'s)."""
    import torch

    last = log_dir / "checkpoints" / "last.ckpt"
    return torch.load(last, map_location="cpu", weights_only=True)["global_step"] if last.exists() else -1


def test_the_run_test_runs_most_of_the_docs_commands():
    """The run test's reach, so that a change of its rules cannot leave it running next to nothing."""
    runnable = [words for page, words in LIT_RL if _runs(words, page)]
    assert len(runnable) >= 20 and len(RUN_PAGES) >= 8, (len(runnable), RUN_PAGES)


@pytest.mark.parametrize("page", RUN_PAGES)
def test_a_pages_commands_run_in_order_as_a_reader_runs_them(page, tmp_path, monkeypatch, capsys):
    folder = tmp_path / "reader"
    shutil.copytree(READER_FILES, folder)
    (folder / "configs").symlink_to(REPO / "configs")
    for name, text in _page_files(REPO / "docs" / page if page != "README.md" else REPO / page).items():
        (folder / name).write_text(text)
    monkeypatch.chdir(folder)
    # The reader's modules are this folder's: not those another page or test of this process loaded by the same name.
    for module in {path.stem for path in folder.glob("*.py")}:
        monkeypatch.delitem(sys.modules, module, raising=False)
    commands = [words for p, words in LIT_RL if p == page and _runs(words, page)]
    # A page whose commands read its earlier runs (a resume, `runs/...`) runs every command in its own folder.
    reads_runs = any("--ckpt_path" in words or "runs/" in " ".join(words) for words in commands)
    for words in commands:
        args = _expanded(page, words)
        resumes = "--ckpt_path" in args
        if tuple(words) in _ALREADY_RUN and not reads_runs:
            continue  # run word for word for another page
        before = {path: _saved_step(path) for path in folder.glob("runs/*/version_*")}
        steps = ["--trainer.max_steps", "2"] if resumes else []  # one step more than the run it resumes saved
        try:
            run_cli(words[1], *[_stand_in_model(word, tmp_path) for word in args], *SHORTER, *steps)
        except SystemExit as ended:
            assert ended.code in (0, None), f"{page}: lit-rl {' '.join(words[1:])}: {capsys.readouterr().err[-2000:]}"
        after = {path: _saved_step(path) for path in folder.glob("runs/*/version_*")}
        new = set(after) - set(before)
        if words[1] == "fit" and not resumes:  # a run of its own, which trained its step
            (log_dir,) = new
            assert after[log_dir] == 1, f"{page}: lit-rl {' '.join(words[1:])}"
        elif resumes:  # one earlier run went on in its folder, from the step it saved (1) to step 2
            went_on = [(before[path], after[path]) for path in before if after[path] != before[path]]
            assert not new and went_on == [(1, 2)], f"{page}: lit-rl {' '.join(words[1:])}: {before} -> {after}"
        _ALREADY_RUN[tuple(words)] = page


def test_every_command_not_run_says_why():
    """A command the run test leaves out is one of the kinds `NOT_RUN_HERE` names, and each kind still matches a
    command of the docs (a reason outliving its command goes)."""
    commands = [" ".join(_expanded(page, words)) for page, words in LIT_RL]
    for needs in NOT_RUN_HERE:
        assert any(needs in command for command in commands), needs
