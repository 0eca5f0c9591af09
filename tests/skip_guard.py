"""A pytest plugin: under CI (`CI` set, as the CI runner sets it), a test skipped for any reason but missing hardware
(no GPU; a CPU without the instructions a test is about) fails the run, and every such skip is named in the summary.

`pytest.importorskip` turns a broken or missing install (an extra that did not install, a package that no longer
imports) into a skip, and a skip passes: the suite would go green with the test never run. On CI every extra is
installed, so the only expected skips are for hardware: the GPU tests' (`tests/gpu`, "needs a CUDA GPU") and the
tests of CPU instructions this machine lacks ("this CPU ..."). Locally (no `CI`), skips are listed and pass, as
pytest's own `-ra` does.
"""

from __future__ import annotations

import os

import pytest

EXPECTED_SKIP_REASONS = ("needs a CUDA GPU", "this CPU ")  # the reasons a test may be skipped in CI: hardware
unexpected_skips: list[str] = []


def skip_reason(report) -> str:
    """The reason a skipped report gives (`Skipped: ...`)."""
    longrepr = report.longrepr
    return str(longrepr[2]) if isinstance(longrepr, tuple) else str(longrepr)


def _record(report) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = skip_reason(report)
        if not any(expected in reason for expected in EXPECTED_SKIP_REASONS):
            unexpected_skips.append(f"{report.nodeid}: {reason}")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # With xdist this runs in the controller for every worker's report too: the controller sees them all.
    _record(report)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    # A module-level `pytest.importorskip` skips the whole module at collection (xdist forwards these too).
    _record(report)


def under_ci() -> bool:
    """Whether this is a CI run: `CI` set to anything but empty, 0 or false."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if unexpected_skips and not hasattr(config, "workerinput"):
        verdict = "fail the run under CI" if under_ci() else "would fail the run under CI"
        terminalreporter.write_line(
            f"{len(unexpected_skips)} tests skipped for another reason than missing hardware ({verdict}):"
        )
        for line in unexpected_skips:
            terminalreporter.write_line(f"  {line}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if hasattr(session.config, "workerinput"):  # an xdist worker: the controller decides
        return
    if unexpected_skips and under_ci() and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
