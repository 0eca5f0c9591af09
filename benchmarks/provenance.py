"""Where a results file comes from: machine, versions, commit and whether the tree was dirty; and the rule that keeps
`benchmarks/results/` clean.

Every benchmark script writes its JSON through `write_report`. A path inside this checkout's `benchmarks/results/`
is refused from a dirty tree unless the script was given `--allow-dirty` (then the JSON says `"dirty": true`);
any other path (a test's tmp_path, /tmp) is written either way, with the state recorded. Dirty means: a tracked
file differs from the commit, an untracked file (not ignored) exists outside `benchmarks/results/`, or `lit_rl`
would be imported from another checkout (an editable install elsewhere; set PYTHONPATH to this checkout). Scripts
check their output path before they run (`check_output`), so a refusal costs nothing, and again when writing.

To write results while others have uncommitted edits: commit, `git clone` the repository, run the script in the
clone with `PYTHONPATH=<clone>`, and copy the JSON back.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
SHOWN_FILES = 8  # dirty files named in a refusal; the rest are counted


def _git(*args: str, repo: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True)


def commit_of(repo: Path = REPO) -> Optional[str]:
    """The checked-out commit, or None outside a git checkout."""
    result = _git("rev-parse", "HEAD", repo=repo)
    return result.stdout.strip() if result.returncode == 0 else None


def _in_results(path: str, repo: Path) -> bool:
    return (repo / path).resolve().is_relative_to((repo / "benchmarks" / "results").resolve())


def _foreign_lit_rl(repo: Path) -> Optional[str]:
    """Where `import lit_rl` would load from, when this checkout has a `lit_rl` package and that is elsewhere."""
    if not (repo / "lit_rl").is_dir():
        return None
    spec = importlib.util.find_spec("lit_rl")
    origin = Path(spec.origin).resolve() if spec and spec.origin else None
    if origin is None or origin.is_relative_to(repo.resolve()):
        return None
    return f"lit_rl (imported from {origin.parent})"


def dirty_files(repo: Path = REPO) -> list[str]:
    """What makes this checkout differ from its commit: changed tracked files, untracked files that are not ignored,
    and a `lit_rl` imported from elsewhere. Anything under `benchmarks/results/` (results being written) is left out.
    Outside a git checkout: one entry saying so."""
    status = _git("status", "--porcelain", "-z", "--untracked-files=all", repo=repo)
    if status.returncode != 0:
        return [f"{repo} is not a git checkout"]
    entries = status.stdout.split("\0")
    files, index = [], 0
    while index < len(entries):
        entry = entries[index]
        index += 1
        if not entry:
            continue
        if entry[0] in "RC":  # a rename or copy: the next entry is the original path
            index += 1
        path = entry[3:]
        if not _in_results(path, repo):
            files.append(path)
    foreign = _foreign_lit_rl(repo)
    return files + ([foreign] if foreign else [])


def is_results_path(path: Path, repo: Path = REPO) -> bool:
    """Whether `path` lies in this checkout's `benchmarks/results/` (where only clean results go)."""
    return Path(path).resolve().is_relative_to((repo / "benchmarks" / "results").resolve())


def refusal(path: Path, dirty: list[str]) -> str:
    """The one-line error for a results path from a dirty tree, naming the dirty files."""
    more = len(dirty) - SHOWN_FILES
    shown = ", ".join(dirty[:SHOWN_FILES]) + (f" and {more} more" if more > 0 else "")
    return (
        f"{Path(sys.argv[0]).name}: error: refusing to write {path} from a dirty tree ({shown}); commit and run in a "
        f'clean clone, or pass --allow-dirty (the JSON then says "dirty": true)'
    )


def check_output(path: Optional[Path], allow_dirty: bool = False, repo: Path = REPO) -> None:
    """Exit with `refusal` when `path` is a results path, the tree is dirty and `allow_dirty` is off."""
    if path is None or allow_dirty or not is_results_path(path, repo):
        return
    dirty = dirty_files(repo)
    if dirty:
        raise SystemExit(refusal(path, dirty))


def add_allow_dirty(parser: argparse.ArgumentParser) -> None:
    """The `--allow-dirty` flag every script that writes results takes."""
    parser.add_argument(
        "--allow-dirty",
        action="store_true",
        help='write into benchmarks/results/ from a dirty tree (the JSON then says "dirty": true)',
    )


def add_report_options(parser: argparse.ArgumentParser) -> None:
    """`--out`, `--markdown` and `--allow-dirty`, the options of a script whose results the README quotes (with
    `--markdown`, the script prints them with `print_markdown` instead of measuring)."""
    parser.add_argument("--out", type=Path, default=None, help="the results JSON")
    parser.add_argument(
        "--markdown", type=Path, default=None, help="print the README's table and numbers of a results JSON"
    )
    add_allow_dirty(parser)


def publish(args: argparse.Namespace, results, markdown_table, claims, **report) -> None:
    """Print what the README quotes of `results` (`markdown_table`, `claims`), and write them to `--out`, if given
    (`write_report`, with `report`'s fields)."""
    print(markdown_table(results))
    print("\n".join(claims(results)))
    if args.out:
        write_report(args.out, results, allow_dirty=args.allow_dirty, **report)


def command(repo: Path = REPO) -> str:
    """This process's command line, the script's path relative to the checkout (as the README quotes it)."""
    script = Path(sys.argv[0])
    if script.is_absolute() and script.resolve().is_relative_to(repo.resolve()):
        script = script.resolve().relative_to(repo.resolve())
    return shlex.join([str(script), *sys.argv[1:]])


def source_tree(repo: Path = REPO, commit: Optional[str] = None) -> Optional[str]:
    """The git tree hash of the checkout's files (tracked and untracked, not ignored), or of `commit`'s, leaving
    `benchmarks/results/` out: a content address that says which commit a dirty-looking tree really was. A lent GPU
    machine gets the working tree with the `.git` of the session's start, so its HEAD can lag the files it runs."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "GIT_INDEX_FILE": str(Path(tmp) / "index")}

        def git(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, env=env)

        if commit is None:
            filled = git("add", "-A", "--", ".", ":(exclude)benchmarks/results")
        else:
            filled = git("read-tree", commit)
            if filled.returncode == 0:
                filled = git("rm", "-r", "--cached", "-q", "-f", "--ignore-unmatch", "benchmarks/results")
        tree = git("write-tree") if filled.returncode == 0 else filled
        return tree.stdout.strip() if tree.returncode == 0 else None


# The instruction sets that decide CPU matmul speed: AMX and AVX-512's bfloat16 make bf16 several times fp32's peak.
MATMUL_FEATURES = ("amx_bf16", "avx512_bf16", "avx512f", "avx2")


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict:
    """The CPU's model name and which of `MATMUL_FEATURES` it has, from Linux's /proc/cpuinfo (nothing elsewhere):
    the same script gives other numbers on another CPU of the same architecture, and a result file says which."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return {}
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    flags = set(fields.get("flags", "").split())
    return {"cpu": fields.get("model name", ""), "cpu_features": [f for f in MATMUL_FEATURES if f in flags]}


def environment(repo: Path = REPO) -> dict:
    """Machine, library versions, commit, and whether the tree was dirty (with the dirty files when it was)."""
    import torch

    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for package in ("lightning", "transformers", "vllm", "deepspeed"):
        try:
            versions[package] = __import__(package).__version__
        except ImportError:
            versions[package] = None
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    dirty = dirty_files(repo)
    return {
        "machine": {
            "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
            **cpu_model(),
            "gpu": gpu,
        },
        "versions": versions,
        "commit": commit_of(repo),
        "tree": source_tree(repo),
        "dirty": bool(dirty),
        **({"dirty_files": dirty} if dirty else {}),
    }


def write_report(
    path: Path,
    results,
    versions: Optional[dict] = None,
    allow_dirty: bool = False,
    repo: Path = REPO,
    **extra,
) -> None:
    """The results JSON: machine, versions (plus `versions`), commit and dirty flag, the exact command, `extra` fields
    and the results. Refused (`check_output`) for a results path from a dirty tree unless `allow_dirty`."""
    check_output(path, allow_dirty, repo)
    report = environment(repo) | {"command": command(repo), **extra, "results": results}
    report["versions"].update(versions or {})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


def print_markdown(path: Path, markdown_table, claims=None) -> None:
    """What a script's `--markdown PATH` prints: the README table of the results file at `path` and, when the script
    has them, its prose numbers (`claims`), one a line."""
    results = json.loads(Path(path).read_text())["results"]
    print(markdown_table(results))
    if claims is not None:
        print("\n".join(claims(results)))


def parse_report_args(
    parser: argparse.ArgumentParser, markdown_table, claims=None, repo: Path = REPO
) -> argparse.Namespace:
    """The command line of a script whose results the README quotes: `add_report_options`, then what every such
    script does before measuring. `--markdown PATH` prints that results file's tables (`print_markdown`) and exits;
    an `--out` into benchmarks/results/ from a dirty tree exits with the one-line refusal (`check_output`) before any
    time is spent measuring."""
    add_report_options(parser)
    args = parser.parse_args()
    if args.markdown:
        print_markdown(args.markdown, markdown_table, claims)
        raise SystemExit(0)
    check_output(args.out, args.allow_dirty, repo)
    return args
