"""Move a lit-rl 0.1 config's flat model keys into 0.2's groups, keeping its comments and layout.

    python -m lit_rl.migrate my_grpo.yaml            # prints the migrated config
    python -m lit_rl.migrate --in-place my_grpo.yaml

`model.init_args.temperature: 0.7` becomes `model.init_args.sampling.temperature: 0.7` (the map is
`lit_rl.config.MOVED_KEYS`); every other line is left as it is. Command-line keys move the same way
(`--model.temperature` -> `--model.sampling.temperature`), which `lit-rl fit` says in one line when it meets one.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Callable

import yaml

from lit_rl.config import GROUP_NAMES, MOVED_KEYS
from lit_rl.rollout.engine_config import dropped_0_1_options, engine_of_0_1

_ENTRY = re.compile(r"^(\s*)([A-Za-z_][\w]*):")
# SFT keeps `max_prompt_length` as its own key (it truncates its data; it samples nothing).
_OWN_KEYS = {"SFT": {"max_prompt_length"}}
_AMBIGUOUS = ("max_prompt_length",)  # where the file names no algorithm


def migrate_text(text: str, warn: Callable[[str], None] = lambda message: None) -> str:
    """The config `text` with `model.init_args`' flat 0.1 keys moved into their groups (unchanged when none). A
    group the config has already takes the moved keys at its end. `warn` hears of a key left in place."""
    lines = text.splitlines(keepends=True)
    model = _block_start(lines, 0, len(lines), "model", 0)
    if model is None:
        return text
    model_end = _block_end(lines, model, 0)
    init = _block_start(lines, model + 1, model_end, "init_args", None)
    if init is None:
        return text
    init_indent = _indent(lines[init])
    init_end = _block_end(lines, init, init_indent)
    found = (re.search(r"class_path:\s*['\"]?([\w.]+)", line) for line in lines[model:model_end])
    class_path = next((m.group(1) for m in found if m), None)
    own = _OWN_KEYS.get(class_path.rsplit(".", 1)[-1], set()) if class_path else set(_AMBIGUOUS)
    entries = _entries(lines, init + 1, init_end)
    moved: dict[str, list[str]] = {group: [] for group in GROUP_NAMES}
    kept: list[tuple[str | None, list[str]]] = []
    first_moved = None
    for key, block in entries:
        place = MOVED_KEYS.get(key) if key is not None and key not in own else None
        if place is None:
            if key in _AMBIGUOUS and class_path is None:
                warn(f"model.init_args.{key} left in place: SFT takes it as its own, the others as {MOVED_KEYS[key]}")
            kept.append((key, block))
            continue
        group, field = place.split(".")
        if first_moved is None:
            first_moved = len(kept)
        if key == "vllm":  # 0.1's vLLM settings are an engine choice now: its class and its options
            block = _engine_block(block, warn)
        block = [_renamed(line, key, field) if _ENTRY.match(line) else line for line in block]
        moved[group].extend("  " + line if line.strip() else line for line in block)
    if first_moved is None:
        return text
    existing = {key: block for key, block in kept if key in GROUP_NAMES}
    for group, block in existing.items():  # a group the config has: the moved keys go at its end
        block.extend(moved.pop(group))
    child_indent = " " * (_entry_indent(entries) or init_indent + 2)
    new_groups = [(group, [f"{child_indent}{group}:\n", *body]) for group, body in moved.items() if body]
    body = kept[:first_moved] + new_groups + kept[first_moved:]
    return "".join(lines[: init + 1] + [line for _, block in body for line in block] + lines[init_end:])


def _engine_block(block: list[str], warn: Callable[[str], None]) -> list[str]:
    """A `vllm:` entry (comments above it kept) as the `engine:` entry it means now (`engine_of_0_1`)."""
    start = next(index for index, line in enumerate(block) if _ENTRY.match(line))
    indent = _indent(block[start])
    body = [line[indent:] if line.strip() else line for line in block[start:]]
    if any(line.lstrip().startswith("#") or " #" in line for line in body):
        warn("model.init_args.vllm: its comments are not carried into model.init_args.rollout.engine")
    vllm = yaml.safe_load("".join(body))["vllm"]
    engine = engine_of_0_1(vllm)
    for key in dropped_0_1_options(vllm):
        warn(f"model.init_args.vllm.{key} left out: {engine['class_path'].rsplit('.', 1)[-1]} does not take it")
    text = yaml.safe_dump({"engine": engine}, sort_keys=False, default_flow_style=False)
    return block[:start] + [" " * indent + line + "\n" for line in text.splitlines()]


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _block_start(lines: list[str], start: int, end: int, key: str, indent) -> int | None:
    for index in range(start, end):
        match = _ENTRY.match(lines[index])
        if match and match.group(2) == key and (indent is None or len(match.group(1)) == indent):
            return index
    return None


def _block_end(lines: list[str], start: int, indent: int) -> int:
    """The first line after `start` that is back at `indent` or less (comments and blank lines belong inside)."""
    for index in range(start + 1, len(lines)):
        line = lines[index]
        if line.strip() and not line.lstrip().startswith("#") and _indent(line) <= indent:
            return index
    return len(lines)


def _entries(lines: list[str], start: int, end: int) -> list[tuple[str | None, list[str]]]:
    """The entries of a mapping block: (key, its lines), comments above an entry going with it."""
    entries: list[tuple[str | None, list[str]]] = []
    indent = _entry_indent_of(lines[start:end])
    pending: list[str] = []
    for line in lines[start:end]:
        match = _ENTRY.match(line)
        if match and len(match.group(1)) == indent:
            entries.append((match.group(2), pending + [line]))
            pending = []
        elif not line.strip() or (line.lstrip().startswith("#") and _indent(line) <= indent):
            pending.append(line)
        elif entries:  # a line of the last entry's value; blank lines before it were inside the value too
            entries[-1][1].extend(pending + [line])
            pending = []
        else:
            pending.append(line)
    if pending:
        entries.append((None, pending))
    return entries


def _entry_indent_of(lines: list[str]) -> int:
    return min((_indent(line) for line in lines if _ENTRY.match(line)), default=0)


def _entry_indent(entries) -> int:
    for key, block in entries:
        if key is not None:
            return next(_indent(line) for line in block if _ENTRY.match(line))
    return 0


def _renamed(line: str, old: str, new: str) -> str:
    return re.sub(rf"^(\s*){old}:", rf"\g<1>{new}:", line, count=1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lit_rl.migrate", description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="+", type=Path)
    parser.add_argument("--in-place", action="store_true", help="rewrite each file instead of printing it")
    args = parser.parse_args(argv)
    for path in args.configs:
        migrated = migrate_text(path.read_text(), warn=lambda message: print(f"{path}: {message}", file=sys.stderr))
        if args.in_place:
            path.write_text(migrated)
        else:
            sys.stdout.write(migrated)


if __name__ == "__main__":
    main()
