"""`lit-rl export` as a user runs it on files that are not what it expects, and into a directory an earlier export
wrote: one line naming the file for a checkpoint it cannot read or an `out_dir` that is a file; the directory
replaced whole, and left as it was when the export fails."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lit_rl.errors import LitRLError
from lit_rl.export import MANIFEST, export_checkpoint
from lit_rl.modeling.models import load_causal_lm, load_tokenizer
from tests.conftest import cli_env

TINY = "lit-rl/tiny-qwen2-base"


def _checkpoint(path: Path, **hyper_parameters) -> Path:
    """A checkpoint of the tiny model's weights as lit-rl saves them (`policy.*`), with `hyper_parameters`."""
    model = load_causal_lm(TINY, random_init=True)
    tokenizer = load_tokenizer(TINY)
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:  # as training sizes it for its pad token
        model.resize_token_embeddings(len(tokenizer))
    state = {f"policy.{key}": value for key, value in model.state_dict().items()}
    if "critic_model_name_or_path" in hyper_parameters:
        state["critic.score.weight"] = torch.zeros(1, 8)
    torch.save(
        {"state_dict": state, "hyper_parameters": {"policy": {"model_name_or_path": TINY}, **hyper_parameters}}, path
    )
    return path


def _export(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lit_rl.export", *args], env=cli_env(), capture_output=True, text=True, timeout=300
    )


def test_an_export_replaces_an_earlier_ones_directory_whole(tmp_path, monkeypatch):
    """Files of an earlier export stayed beside the new one's: a PPO export's `critic/`, or an adapter's
    `adapter_config.json` beside merged weights, which transformers then loads as an adapter. An export lists what
    it wrote in `.lit-rl-export`; a later one replaces those, and refuses a directory holding anything else."""
    out = tmp_path / "out"
    assert export_checkpoint(_checkpoint(tmp_path / "policy.ckpt"), out) == out
    written = sorted(path.name for path in out.iterdir())
    assert {"config.json", "model.safetensors", MANIFEST} <= set(written)
    assert not [path.name for path in tmp_path.iterdir() if path.name.startswith(".")]  # no temporary left
    listed = json.loads((out / MANIFEST).read_text())
    assert listed == sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.name != MANIFEST)
    # An earlier export's critic/ files (listed in its manifest) go; a second export by a relative path replaces it.
    (out / "critic").mkdir()
    (out / "critic" / "config.json").write_text("{}")
    (out / MANIFEST).write_text(json.dumps([*listed, "critic/config.json"]))
    monkeypatch.chdir(tmp_path)
    assert export_checkpoint(tmp_path / "policy.ckpt", "out") == Path("out")
    assert sorted(path.name for path in out.iterdir()) == written
    # A file of the user's inside a listed folder is not the export's: refused, as every file is listed.
    (out / "critic").mkdir()
    (out / "critic" / "notes.txt").write_text("mine")
    with pytest.raises(LitRLError, match=r"holds files a lit-rl export did not write \(critic/notes.txt\)"):
        export_checkpoint(tmp_path / "policy.ckpt", out)
    (out / "critic" / "notes.txt").unlink()
    (out / "critic").rmdir()
    # The working directory (or one above it) is never replaced, even when it is an export.
    monkeypatch.chdir(out)
    with pytest.raises(LitRLError, match=r"^out_dir \.: the working directory or one above it"):
        export_checkpoint(tmp_path / "policy.ckpt", ".")
    # Nor the model a checkpoint was trained from, though an earlier export: its weights are read from it.
    monkeypatch.chdir(tmp_path)
    trained_from_it = _checkpoint(tmp_path / "from-out.ckpt", policy={"model_name_or_path": str(out)})
    with pytest.raises(LitRLError, match=f"^out_dir {out} is '{out}', which this checkpoint was trained from"):
        export_checkpoint(trained_from_it, out)
    referenced = _checkpoint(tmp_path / "dpo.ckpt", ref_model_name_or_path=str(out))  # DPO's reference
    with pytest.raises(LitRLError, match=f"^out_dir {out} is '{out}', which this checkpoint was trained from"):
        export_checkpoint(referenced, out)
    assert sorted(path.name for path in out.iterdir()) == written


def test_an_export_keeps_the_models_generation_settings(tmp_path):
    """An instruct model's stop tokens live in `generation_config.json` (Qwen2.5's [151645, 151643]); the export
    rebuilt it from `config.json` (one eos id, no sampling defaults), so transformers and vLLM lost the end-of-turn
    stop, while the run's own `hf/` kept it (an outside read found it)."""
    import shutil

    from lit_rl.modeling.models import resolve_model_path

    model = shutil.copytree(resolve_model_path(TINY), tmp_path / "instruct")
    settings = {"eos_token_id": [256, 10], "do_sample": True, "temperature": 0.7, "top_p": 0.9}
    (model / "generation_config.json").write_text(json.dumps(settings))
    checkpoint = _checkpoint(tmp_path / "policy.ckpt", policy={"model_name_or_path": str(model)})
    out = export_checkpoint(checkpoint, tmp_path / "out")
    written = json.loads((out / "generation_config.json").read_text())
    assert {key: written.get(key) for key in settings} == settings
    plain = export_checkpoint(_checkpoint(tmp_path / "plain.ckpt"), tmp_path / "plain")  # none: the derived one
    assert json.loads((plain / "generation_config.json").read_text())["_from_model_config"] is True
    # One save_pretrained refuses (a temperature without do_sample) does not fail the export: the derived one.
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": 256, "temperature": 0.7}))
    out = export_checkpoint(checkpoint, tmp_path / "out")
    assert "temperature" not in json.loads((out / "generation_config.json").read_text())


def test_a_relative_model_path_that_is_not_here_says_where_it_is_read_from(tmp_path):
    """A run given `runs/sft/version_0/hf` keeps that path; an export from another folder said only that it does not
    exist (an outside read found it)."""
    checkpoint = _checkpoint(tmp_path / "policy.ckpt", policy={"model_name_or_path": "./runs/sft/version_0/hf"})
    result = _export(str(checkpoint), str(tmp_path / "out"))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "lit-rl export: error: model path './runs/sft/version_0/hf' does not exist here (a checkpoint keeps its "
        "model paths as the run was given them: run lit-rl export from the folder the run was started in for a "
        "relative one)"
    )


def test_a_failed_export_leaves_the_directory_as_it_was(tmp_path):
    """The critic's model cannot be loaded: before, the new policy had been written over the old export's by then,
    and the error was a traceback."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text('{"earlier": true}')
    (out / MANIFEST).write_text('["config.json"]')  # an earlier export's
    checkpoint = _checkpoint(tmp_path / "ppo.ckpt", critic_model_name_or_path=str(tmp_path / "no-such-critic"))
    result = _export(str(checkpoint), str(out))
    assert result.returncode == 1, result.stderr[-2000:]
    assert result.stderr.splitlines()[-1].startswith(f"lit-rl export: error: model '{tmp_path / 'no-such-critic'}': ")
    assert sorted(path.name for path in out.iterdir()) == [MANIFEST, "config.json"]
    assert (out / "config.json").read_text() == '{"earlier": true}'
    assert not [path.name for path in tmp_path.iterdir() if path.name.startswith(".")]


def test_an_export_that_fails_while_writing_leaves_the_directory_as_it_was(tmp_path, monkeypatch):
    """A failure after the new files are being written (the critic's, here): `out` keeps the earlier export, and
    the directory the new one was written in is gone."""
    import lit_rl.export

    out = tmp_path / "out"
    export_checkpoint(_checkpoint(tmp_path / "policy.ckpt"), out)
    before = {path: path.read_bytes() for path in out.rglob("*") if path.is_file()}

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(lit_rl.export, "save_value_state", full_disk)
    with pytest.raises(OSError, match="No space left on device"):
        export_checkpoint(_checkpoint(tmp_path / "ppo.ckpt", critic_model_name_or_path=TINY), out)
    assert {path: path.read_bytes() for path in out.rglob("*") if path.is_file()} == before
    assert not [path.name for path in tmp_path.iterdir() if path.name.startswith(".")]


def test_what_export_cannot_read_or_write_is_one_line_naming_it(tmp_path):
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(_checkpoint(tmp_path / "whole.ckpt").read_bytes()[:4096])
    not_deepspeed = tmp_path / "not-deepspeed"
    not_deepspeed.mkdir()
    for checkpoint, named in ((truncated, "checkpoint"), (not_deepspeed, "checkpoint directory")):
        result = _export(str(checkpoint), str(tmp_path / "out"))
        assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr[-2000:]
        assert result.stderr.startswith(f"lit-rl export: error: {named} {checkpoint} cannot be read (")

    # A directory an export did not write (a run's, the user's own, one named as a model's files are) would be
    # deleted by the swap: refused before the checkpoint loads, naming what is there; so is the file system's root.
    for names in (("metrics.csv", "config.json", "checkpoints"), ("README.md", "config.json")):
        mine = tmp_path / f"mine-{len(names)}"
        mine.mkdir()
        for name in names:
            (mine / name).touch()
        listed = ", ".join(sorted(names)[:3])
        with pytest.raises(
            LitRLError, match=f"^out_dir {mine} holds files a lit-rl export did not write \\({listed}\\)"
        ):
            export_checkpoint(tmp_path / "whole.ckpt", mine)
        assert sorted(path.name for path in mine.iterdir()) == sorted(names)
    with pytest.raises(LitRLError, match="the working directory or one above it"):
        export_checkpoint(tmp_path / "whole.ckpt", Path("/"))

    a_file = tmp_path / "model.txt"
    a_file.write_text("mine")
    with pytest.raises(LitRLError, match=f"out_dir {a_file} is a file: give the directory to write"):
        export_checkpoint(tmp_path / "whole.ckpt", a_file)
    assert a_file.read_text() == "mine"


def test_a_file_that_is_no_checkpoint_is_unreadable_not_code(tmp_path):
    """A YAML config, or an old-format (non-zip) checkpoint cut short inside the name of a class it pickles
    (`torch._utils._rebuild_tensor_v2`), fails to unpickle too: it was said to hold objects that "may run code".
    That is for a GLOBAL torch refuses in a whole file (a crafted one: tests/test_security.py); these cannot be
    read."""
    from lit_rl.export import load_checkpoint
    from lit_rl.resume import CheckpointError

    config = tmp_path / "grpo.yaml"
    config.write_text("model:\n  policy:\n    model_name_or_path: lit-rl/tiny-qwen2-base\n")
    old_format = tmp_path / "old.ckpt"
    torch.save({"state_dict": {"policy.w": torch.zeros(3)}}, old_format, _use_new_zipfile_serialization=False)
    whole = old_format.read_bytes()
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(whole[: whole.index(b"_rebuild_tensor_v2") + 8])  # inside the name
    with pytest.raises(CheckpointError, match=f"^checkpoint {config} cannot be read \\(UnpicklingError: Unsupported "):
        load_checkpoint(config)
    with pytest.raises(CheckpointError, match=f"^checkpoint {cut} cannot be read \\(it ends inside a pickled name"):
        load_checkpoint(cut)
    assert load_checkpoint(old_format)["state_dict"]["policy.w"].shape == (3,)

    # A refused class in a whole old-format file is still one that may run code.
    torch.save({"state_dict": {}, "path": Path("x")}, old_format, _use_new_zipfile_serialization=False)
    with pytest.raises(LitRLError, match=r"\(pathlib\.\w*Path\), which lit-rl does not unpickle: it may run code$"):
        load_checkpoint(old_format)
