"""How long CI takes: `bash .ci/run` (the README's test command) in a fresh clone and a fresh virtual environment.

    python benchmarks/ci_time.py --out benchmarks/results/ci_time.json     # clone HEAD, new venv, bash .ci/run
    python benchmarks/ci_time.py --markdown benchmarks/results/ci_time.json  # the README's sentence
    python benchmarks/ci_time.py --log /tmp/ci.log        # also keep pytest's whole output (its warnings)

Clones this checkout's HEAD into a temporary directory, creates a virtual environment there (`python -m venv`),
and runs `bash .ci/run` inside it with the environment's `bin/` first on PATH and `CI=true` (as CI runs it), timed
from start to exit. The test time is pytest's own (its last summary line, which also gives the counts); installing
is the rest. The clone is of a commit, so the result is clean whatever the state of this tree; its commit is the one
recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from provenance import command, environment  # noqa: E402
from run_report import duration  # noqa: E402

SUMMARY = re.compile(r"=+ (?P<counts>.*?) in (?P<seconds>[0-9.]+)s\b.*=+\s*$")


def parse_pytest_summary(output: str) -> dict:
    """Counts (passed, skipped, failed, ...) and seconds from pytest's last summary line."""
    for line in reversed(output.splitlines()):
        match = SUMMARY.search(line)
        if match:
            counts = {name: int(n) for n, name in re.findall(r"(\d+) (\w+)", match["counts"])}
            return {"tests_s": float(match["seconds"]), **counts}
    raise ValueError("no pytest summary line in the output")


DURATION = re.compile(r"^(?P<seconds>[0-9.]+)s (?P<phase>call|setup|teardown)\s+(?P<test>.+?)\s*$")


def slowest_tests(output: str, count: int = 25) -> list[dict]:
    """pytest's `--durations` lines (the slowest calls, setups and teardowns), slowest first."""
    rows = [m.groupdict() for line in output.splitlines() if (m := DURATION.match(line.strip()))]
    rows = [{"test": r["test"], "phase": r["phase"], "seconds": float(r["seconds"])} for r in rows]
    return sorted(rows, key=lambda r: -r["seconds"])[:count]


def failure_report(output: str, limit: int = 12000) -> str:
    """pytest's FAILURES section (tracebacks and captured output), at most `limit` characters of its start: a
    failure seen once in a long run can be read afterwards."""
    start = output.find("= FAILURES =")
    if start < 0:
        return ""
    end = output.find("short test summary info", start)
    section = output[output.rfind("\n", 0, start) + 1 : end if end > 0 else None]
    return section[:limit]


def measure(workdir: Path, log: Path | None = None) -> dict:
    """`bash .ci/run` in a fresh clone of HEAD with a fresh virtual environment: seconds in all, for the tests
    (pytest's), for installing (the rest), and pytest's counts."""
    clone, venv = workdir / "clone", workdir / "venv"
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # CI=true as CI sets it (tests/skip_guard.py then fails the run on a skip for any reason but no GPU).
    env = os.environ | {
        "CI": "true",
        "VIRTUAL_ENV": str(venv),
        "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}",
    }
    env.pop("PYTHONPATH", None)
    started = time.monotonic()
    result = subprocess.run(["bash", ".ci/run"], cwd=clone, env=env, capture_output=True, text=True)
    total = time.monotonic() - started
    (log or workdir / "ci.log").write_text(result.stdout + result.stderr)  # the whole output: warnings included
    if result.returncode != 0:  # what failed and why, before the temporary directory goes
        failed = [line for line in result.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
        print("\n".join(failed) or result.stdout[-3000:], file=sys.stderr)
        print(failure_report(result.stdout), file=sys.stderr)
    summary = parse_pytest_summary(result.stdout)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=clone, capture_output=True, text=True).stdout.strip()
    return (
        {"commit": commit, "returncode": result.returncode, "total_s": total}
        | summary
        | {
            "install_s": total - summary["tests_s"],
            "cores": os.cpu_count(),
            "slowest": slowest_tests(result.stdout),
        }
    )


def claims(results: dict) -> list[str]:
    """The README's sentence of a results file (a test checks the README says it)."""
    counts = ", ".join(
        f"{results[name]} {name}" for name in ("passed", "failed", "skipped", "errors") if name in results
    )
    return [
        f"`bash .ci/run` took {duration(results['total_s'])} on {results['cores']} cores at {results['commit'][:7]}: "
        f"about {duration(results['install_s'])} to install, {duration(results['tests_s'])} of tests ({counts})."
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="JSON results")
    parser.add_argument("--markdown", type=Path, default=None, help="print the README's sentence of a results JSON")
    parser.add_argument("--log", type=Path, default=None, help="keep the run's whole output (pytest's) in this file")
    args = parser.parse_args()
    if args.markdown:
        print("\n".join(claims(json.loads(args.markdown.read_text())["results"])))
        return
    with tempfile.TemporaryDirectory(prefix="lit-rl-ci-time-") as tmp:
        results = measure(Path(tmp), args.log)
    print("\n".join(claims(results)))
    if args.out:
        # What ran is the clone of a commit, clean by construction: its commit is recorded, not this tree's state.
        report = environment() | {"commit": results["commit"], "dirty": False, "command": command()}
        report.pop("dirty_files", None)
        report |= {"measured": "bash .ci/run in a fresh clone and a fresh virtual environment", "results": results}
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    if results["returncode"] != 0:
        sys.exit(f"ci_time.py: error: bash .ci/run failed with {results['returncode']}")


if __name__ == "__main__":
    main()
