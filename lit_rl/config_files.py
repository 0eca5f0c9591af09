"""What is wrong with a `--config` file jsonargparse could not load, or loads wrongly, named with its file and
line: jsonargparse's own messages ("Problems parsing config: while scanning for the next token", "Unexpected
config:") name neither, and a key set twice in one mapping is dropped without a word. Used by the CLI's parser
(`lit_rl.cli.OneLineErrorParser`)."""

from __future__ import annotations

from typing import Optional

import yaml


def config_file_problem(name: str, text: str) -> Optional[str]:
    """Why a `--config` file that jsonargparse could not load is no config, with its line and column: jsonargparse
    says "Problems parsing config: while scanning for the next token" or "Unexpected config:", naming neither the
    file nor the line. None when PyYAML finds nothing wrong (jsonargparse's loader differs in rare cases)."""
    try:
        value = yaml.load(text, Loader=yaml.SafeLoader)  # the Python loader: libyaml's messages omit the character
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        problem = err.problem or err.context or "not YAML"
        if mark is None:
            return f"{name}: {problem}"
        lines = text.splitlines()
        line = lines[mark.line] if mark.line < len(lines) else ""
        tabs = " (YAML indents with spaces, not tabs)" if "\t" in line[: mark.column + 1] else ""
        return f"{name} line {mark.line + 1}, column {mark.column + 1}: {problem}{tabs}"
    except yaml.YAMLError as err:
        return f"{name}: {str(err).strip().splitlines()[0]}"
    if value is None:
        return f"{name}: not a mapping of options ({'it sets nothing' if text.strip() else 'an empty file'})"
    if not isinstance(value, dict):
        return f"{name}: not a mapping of options (a {'list' if isinstance(value, list) else 'single value'})"
    return None


def duplicate_key_problem(name: str, text: str) -> Optional[str]:
    """The first key a `--config` file sets twice in one mapping: YAML loaders keep the last silently, so a second
    `sampling:` block under `init_args` dropped the first. Checked on the composed nodes, before `<<` merges, whose
    keys a mapping may override. None when there is none, or when the file is no YAML (the parser reports that)."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return None
    twice: list[tuple[yaml.Node, yaml.Node]] = []  # (second, first)
    stack, seen = [root], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:  # an alias is the node it names
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            keys: dict[tuple[str, str], yaml.Node] = {}
            for key, value in node.value:
                stack.append(value)
                if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                    if (key.tag, key.value) in keys:
                        twice.append((key, keys[(key.tag, key.value)]))
                    keys.setdefault((key.tag, key.value), key)
        elif isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)
    if not twice:
        return None
    second, first = min(twice, key=lambda pair: pair[0].start_mark.index)
    return (
        f"{name} line {second.start_mark.line + 1}: key '{second.value}' appears twice in one mapping (also on line "
        f"{first.start_mark.line + 1}; the first would be dropped)"
    )
