"""The end of a run when something goes wrong with its outputs: an export folder that cannot be written stops the
run before training, an export that fails at the end keeps the checkpoint and the earlier export, and the summary
names only files that exist."""

from __future__ import annotations

import errno
import json

import pytest
import torch
import yaml

from tests.conftest import CONFIGS, FAST_GRPO, run_cli, write_overlay


def _fit(tmp_path, dirpath=None, *args: str, every_n_train_steps=None) -> None:
    """`lit-rl fit` of configs/grpo.yaml for one step, logging under `tmp_path/runs`, exporting to `dirpath`."""
    overlay = write_overlay(
        tmp_path / "o.yaml", every_n_train_steps=every_n_train_steps, save_dir=tmp_path / "runs", save_last=True
    )
    if dirpath is not None:
        config = yaml.safe_load(overlay.read_text())
        export = {"class_path": "lit_rl.callbacks.SaveHFPretrained", "init_args": {"dirpath": str(dirpath)}}
        config["trainer"]["callbacks"].append(export)
        overlay.write_text(yaml.safe_dump(config))
    config = ["--config", str(CONFIGS / "grpo.yaml"), "--config", str(overlay)]
    run_cli("fit", *config, *FAST_GRPO, "--trainer.max_steps", "1", *args)


def _earlier_export(folder, files: dict[str, bytes]) -> None:
    """`folder` as an earlier export left it: `files` and its list of them."""
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    (folder / ".lit-rl-export").write_text(json.dumps(sorted(files)))


def _error_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lit-rl: error: ")]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("where", ["under_a_file", "a_folder_of_other_files"])
def test_an_export_folder_that_cannot_be_written_stops_the_run_before_training(tmp_path, capsys, where):
    """Found at the end before (after the whole run, and losing its last checkpoint), or not at all (a folder of the
    user's files was written into): now at `setup`, in one line naming the callback's key, before any step."""
    (tmp_path / "afile").write_text("")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    dirpath = tmp_path / "afile" / "hf" if where == "under_a_file" else tmp_path / "mine"
    with pytest.raises(SystemExit) as stop:
        _fit(tmp_path, dirpath)
    assert stop.value.code == 1
    line = _error_line(capsys)
    assert line.startswith(f"lit-rl: error: trainer.callbacks: SaveHFPretrained dirpath {dirpath}"), line
    if where == "under_a_file":
        assert line.endswith(f": cannot be written (FileExistsError: [Errno 17] File exists: '{tmp_path / 'afile'}')")
    else:
        assert "holds files a lit-rl export did not write (notes.txt)" in line
        assert (tmp_path / "mine" / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "runs" / "run" / "version_0" / "metrics.csv").exists()  # no step ran


def test_an_export_that_fails_at_the_end_keeps_the_checkpoint_and_the_earlier_export(tmp_path, capsys, monkeypatch):
    """A disk that fills during the export (after part of it is written): the end-of-training `last.ckpt` is written
    all the same (the export ran before it, and its error skipped it), and the earlier export is left whole."""
    from lit_rl.callbacks import SaveHFPretrained

    def fills_the_disk(pl_module, out, masters) -> None:
        (out / "model.safetensors").write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(SaveHFPretrained, "_save_policy", staticmethod(fills_the_disk))
    dirpath = tmp_path / "export"
    dirpath.mkdir()
    _earlier_export(dirpath, {"model.safetensors": b"earlier", "config.json": b"{}"})
    with pytest.raises(SystemExit) as stop:
        _fit(tmp_path, dirpath, every_n_train_steps=100)
    assert stop.value.code == 1
    assert _error_line(capsys) == (
        f"lit-rl: error: trainer.callbacks: SaveHFPretrained dirpath {dirpath}: the export failed (OSError: [Errno 28] "
        "No space left on device); the run's checkpoints are written, `lit-rl export` makes the model from one"
    )
    last = tmp_path / "runs" / "run" / "version_0" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "o.yaml", "runs"]  # no half-written folder beside
    assert {p.name: p.read_bytes() for p in dirpath.iterdir() if p.name != ".lit-rl-export"} == {
        "model.safetensors": b"earlier",
        "config.json": b"{}",
    }


def test_an_export_replaces_an_earlier_one_whole(tmp_path):
    """No file of an earlier export stays beside the new one (a PPO run's `critic/`, a weight shard)."""
    dirpath = tmp_path / "export"
    dirpath.mkdir()
    _earlier_export(dirpath, {"critic/model.safetensors": b"earlier", "model-00002-of-00002.safetensors": b"x"})
    _fit(tmp_path, dirpath)
    written = json.loads((dirpath / ".lit-rl-export").read_text())
    assert sorted(p.relative_to(dirpath).as_posix() for p in dirpath.rglob("*") if p.is_file()) == sorted(
        [*written, ".lit-rl-export"]
    )
    assert "config.json" in written and "model.safetensors" in written and not (dirpath / "critic").exists()


@pytest.mark.parametrize("option", ["--trainer.log_every_n_steps", "--trainer.max_steps"])
def test_the_summary_names_no_metrics_file_that_was_never_written(tmp_path, capsys, option):
    """The CSV logger makes its file at the first logged row: a run that logs none has no `metrics.csv` to name."""
    _fit(tmp_path, None, option, "0")
    out = capsys.readouterr().out
    assert "lit-rl: done, " in out and "  metrics " not in out, out
    assert not (tmp_path / "runs" / "run" / "version_0" / "metrics.csv").exists()


def test_the_runs_own_hf_folder_written_by_an_older_lit_rl_is_replaced_not_refused(tmp_path):
    """The default `hf/` of a run resumed now may hold an export of lit-rl 0.2, with no `.lit-rl-export` list: it is
    the run's own, replaced as before; the same files in a folder given by hand are refused (they may be the user's)."""
    from lit_rl.callbacks.export import unwritable

    old_export = tmp_path / "version_0" / "hf"
    old_export.mkdir(parents=True)
    (old_export / "config.json").write_text("{}")
    assert unwritable(old_export, own=True) is None
    assert "holds files a lit-rl export did not write (config.json)" in unwritable(old_export, own=False)
