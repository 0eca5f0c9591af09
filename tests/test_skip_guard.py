"""`tests/skip_guard.py`: under CI, a test skipped for any reason but missing hardware fails the run."""

from __future__ import annotations

import pytest

from tests.conftest import REPO

pytest_plugins = ["pytester"]

SKIPS = """
import pytest

def test_runs():
    assert True

@pytest.mark.skipif(True, reason="needs a CUDA GPU")
def test_on_a_gpu():
    pass

@pytest.mark.skipif(True, reason="this CPU has no bfloat16 unit")
def test_of_an_instruction_set():
    pass

def test_with_an_extra():
    pytest.importorskip("no_such_package_lit_rl")
"""

MODULE_SKIP = """
import pytest

pytest.importorskip("no_such_package_lit_rl")


def test_never_collected():
    pass
"""


@pytest.mark.parametrize("ci", [True, False], ids=["ci", "local"])
def test_a_skip_other_than_no_gpu_fails_under_ci_and_is_named(pytester, monkeypatch, ci):
    if ci:
        monkeypatch.setenv("CI", "true")
    else:
        monkeypatch.delenv("CI", raising=False)
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # the plugin is tests/skip_guard.py of this checkout
    pytester.makepyfile(test_skips=SKIPS, test_module_skip=MODULE_SKIP)
    result = pytester.runpytest_subprocess("-p", "tests.skip_guard", "-p", "no:cacheprovider", "-n", "0")
    assert result.ret == (pytest.ExitCode.TESTS_FAILED if ci else pytest.ExitCode.OK)
    result.stdout.fnmatch_lines(
        [
            "2 tests skipped for another reason than missing hardware*",
            "*test_module_skip.py: Skipped: could not import*",
            "*test_with_an_extra: Skipped: could not import*",
        ]
    )
    assert "test_on_a_gpu:" not in result.stdout.str()  # the GPU test's skip is expected, and the CPU's
    assert "test_of_an_instruction_set:" not in result.stdout.str()
