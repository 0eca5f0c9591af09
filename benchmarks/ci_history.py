"""Every recorded CI run: each version of `benchmarks/results/ci_time.json` the repository's history holds (and the
file as it is now, when it records a run not yet committed), oldest first.

    python benchmarks/ci_history.py --out benchmarks/results/ci_history.json   # after recording a new ci_time.json
    python benchmarks/ci_history.py --markdown benchmarks/results/ci_history.json  # the table of docs/results.md

`ci_time.py` measures one run and writes `ci_time.json`, which the next recorded run replaces; this keeps what each
one measured, from the file itself (git), so that the runs the docs compare are each a committed measurement.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from provenance import add_report_options, print_markdown, write_report  # noqa: E402
from run_report import duration  # noqa: E402

CI_TIME = "benchmarks/results/ci_time.json"


def recorded_versions() -> list[tuple[str, str]]:
    """(date the version was committed, its text) for each committed version of `ci_time.json`, oldest first, then
    the working tree's file."""
    log = subprocess.run(
        ["git", "log", "--reverse", "--format=%H %cs", "--", CI_TIME], cwd=REPO, capture_output=True, text=True
    ).stdout.split("\n")
    versions = []
    for line in filter(None, log):
        revision, date = line.split()
        shown = subprocess.run(["git", "show", f"{revision}:{CI_TIME}"], cwd=REPO, capture_output=True, text=True)
        if shown.returncode == 0:  # a commit that deleted the file has no version of it
            versions.append((date, shown.stdout))
    current = REPO / CI_TIME
    if current.is_file():
        versions.append(("not committed", current.read_text()))
    return versions


def run_row(date: str, text: str) -> dict | None:
    """One run's row from a version of `ci_time.json` (None for a version that records no finished run)."""
    try:
        report = json.loads(text)
    except ValueError:
        return None
    results = report.get("results", {})
    if "total_s" not in results:
        return None
    features = report.get("machine", {}).get("cpu_features")
    return {
        "commit": results["commit"][:7],
        "recorded": date,
        "total_s": round(results["total_s"], 1),
        "install_s": round(results["install_s"], 1),
        "tests_s": round(results["tests_s"], 1),
        "passed": results.get("passed", 0),
        "failed": results.get("failed", 0),
        "skipped": results.get("skipped", 0),
        "bf16_unit": None if features is None else "avx512_bf16" in features,
    }


def history() -> list[dict]:
    """The recorded runs, oldest first, each once (a version recommitted unchanged, or the working tree's file
    when it is committed already, is the same run)."""
    rows: dict[tuple, dict] = {}
    for date, text in recorded_versions():
        row = run_row(date, text)
        if row is not None:
            key = (row["commit"], row["total_s"])
            rows.setdefault(key, row)
    return list(rows.values())


def markdown_table(results: list[dict]) -> str:
    """The docs' table of the runs, newest first."""
    unit = {True: "yes", False: "no", None: "?"}
    lines = [
        "| commit | recorded | `bash .ci/run` | install | tests | passed | failed | bf16 unit |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for row in reversed(results):
        lines.append(
            f"| {row['commit']} | {row['recorded']} | {duration(row['total_s'])} | {duration(row['install_s'])} | "
            f"{duration(row['tests_s'])} | {row['passed']} | {row['failed']} | {unit[row['bf16_unit']]} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_report_options(parser)
    args = parser.parse_args()
    if args.markdown:
        print_markdown(args.markdown, markdown_table)
        return
    results = history()
    print(markdown_table(results))
    if args.out:
        write_report(args.out, results, allow_dirty=args.allow_dirty, source=f"each version of {CI_TIME} in git")


if __name__ == "__main__":
    main()
