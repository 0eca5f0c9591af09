"""Rows from local files (JSONL, JSON, parquet), Hugging Face `datasets` (a `save_to_disk` directory, an `.arrow`
file, a hub id), built-in tasks (`builtin:<task>/<split>`), reasoning-gym's tasks (`reasoning_gym:<task>?...`) or a
verifiers taskset's (`verifiers:<taskset>?...`)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any, Optional, Sequence

from lit_rl.data import hf_datasets
from lit_rl.data.arithmetic import BUILTIN_DATASETS
from lit_rl.data.reasoning_gym import is_reasoning_gym, load_reasoning_gym_rows
from lit_rl.data.verifiers_tasksets import is_verifiers, load_verifiers_rows
from lit_rl.errors import DataError, DataFileNotFound, one_line

Row = dict[str, Any]


def load_rows(spec: str) -> list[Row]:
    """Load every row of `spec`:
    - `builtin:addition/train`;
    - `reasoning_gym:<task>?size=...&seed=...` (`lit_rl.data.reasoning_gym`);
    - `verifiers:<taskset>?select.limit=...` (`lit_rl.data.verifiers_tasksets`);
    - a `.jsonl`, `.json` or `.parquet` file;
    - a Hugging Face dataset: a `save_to_disk` directory (`dir`, or `dir:split` for a `DatasetDict`), an `.arrow`
      file, or a hub id `owner/name[:split]` / `owner/name:config:split` (`datasets.load_dataset`, cached; without
      a split, the only split or `train`).
    """
    if is_reasoning_gym(spec):
        return load_reasoning_gym_rows(spec)
    if is_verifiers(spec):
        return load_verifiers_rows(spec)
    if spec.startswith("builtin:"):
        name, _, split = spec[len("builtin:") :].partition("/")
        if name not in BUILTIN_DATASETS:
            raise DataError(f"unknown built-in dataset {spec!r}; known: {sorted(BUILTIN_DATASETS)}")
        return BUILTIN_DATASETS[name](split or "train")
    path = Path(spec)
    directory, _, split = spec.rpartition(":") if ":" in spec and not path.exists() else (spec, "", "")
    if Path(directory).is_dir():
        return hf_datasets.rows_from_disk(Path(directory), split or None, spec)
    if not path.is_file():
        if hf_datasets.looks_like_hub_id(spec):
            return hf_datasets.rows_from_hub(spec)
        raise DataFileNotFound(f"data file {spec!r} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".arrow":
        return hf_datasets.rows_from_arrow(path)
    if suffix == ".jsonl":
        return _read_jsonl(path)
    if suffix == ".json":
        return _read_json(path)
    if suffix == ".parquet":
        return _read_parquet(path)
    raise DataError(
        f"data file {spec!r}: unsupported extension {suffix!r} (use .jsonl, .json, .parquet, .arrow or a "
        "datasets directory)"
    )


def _read_jsonl(path: Path) -> list[Row]:
    rows = []
    # Bytes, decoded line by line, so that a byte that is not UTF-8 is named by its line; bytes' `splitlines` ends
    # lines where text mode does (\n, \r\n, \r), as `record_label` counts them.
    for line_number, raw in enumerate(path.read_bytes().splitlines(), start=1):
        line = _utf8(raw, path, line_number)
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}: line {line_number}: malformed JSON ({err.msg})") from None
        if not isinstance(row, dict):
            raise DataError(f"{path}: line {line_number}: each line must be a JSON object")
        rows.append(row)
    return rows


def _read_json(path: Path) -> list[Row]:
    """The rows of a `.json` file: a list of rows, or a dict of columns (`{"prompt": [...], "answer": [...]}`)."""
    raw = path.read_bytes()
    try:
        data = json.loads(_utf8(raw, path, 1))
    except json.JSONDecodeError as err:
        raise DataError(f"{path}: line {err.lineno}: malformed JSON ({err.msg})") from None
    if isinstance(data, dict):
        return _rows_of_columns(data, path)
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a list of rows or a dict of columns")
    return data


def _utf8(raw: bytes, path: Path, first_line: int) -> str:
    """`raw`, from line `first_line` of `path`, as text: data files are UTF-8 whatever the machine's locale says, and
    a byte that is not is named by its line, not left to a `UnicodeDecodeError` traceback."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = first_line + raw.count(b"\n", 0, err.start)
        raise DataError(f"{path}: line {line}: not UTF-8 text ({err.reason}: {raw[err.start : err.end]!r})") from None


def _rows_of_columns(columns: dict[str, Any], path: Path) -> list[Row]:
    """Rows of a column-oriented `.json` file. Every column must be a list, all of one length: a shorter column would
    silently drop rows, and a text value would be read as one row per character."""
    first, count = None, 0
    for name, values in columns.items():
        if not isinstance(values, list):
            raise DataError(f"{path}: column {name!r} is a {type(values).__name__}, not a list of one value per row")
        if first is None:
            first, count = name, len(values)
        elif len(values) != count:
            raise DataError(f"{path}: column {name!r} has {len(values)} values, column {first!r} has {count}")
    return [dict(zip(columns, values)) for values in zip(*columns.values())]


def _read_parquet(path: Path) -> list[Row]:
    """The rows of a `.parquet` file; one that pyarrow cannot read is named in one line, not an Arrow traceback."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except pa.ArrowException as err:
        raise DataError(f"data file {str(path)!r}: not a readable parquet file ({one_line(err, 200)})") from None


def validate_rows(rows: Sequence[Row], required: Sequence[str], source: str) -> None:
    """Fail on an empty data set, or a row missing a required column or holding one that is neither text nor chat
    messages (naming its line or record, see `record_label`), before a chat template fails on it mid-run."""
    if not rows:
        raise DataError(f"{source}: the data set is empty")
    for index, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"{source}: {record_label(source, index)} must be an object with named columns")
        for column in required:
            value = row.get(column)
            if value is None:
                raise DataError(f"{source}: {record_label(source, index)} has no {column!r} column")
            problem = None if isinstance(value, str) else _not_messages(value)
            if problem:
                raise DataError(
                    f"{source}: {record_label(source, index)} column {column!r} must be text or chat messages "
                    f"([{{'role': ..., 'content' or 'tool_calls': ...}}, ...]): {problem}"
                )


def _not_messages(value: Any) -> Optional[str]:
    """What keeps `value` from being chat messages (a non-empty list of dicts, each with a `role` and its `content`
    or, an assistant's call of tools, its `tool_calls`; TRL's `is_conversational` looks at the first one's `role`
    only), or None when it is."""
    if not isinstance(value, list):
        return f"it is a {type(value).__name__}"
    if not value:
        return "it is an empty list"
    for number, message in enumerate(value, start=1):
        if not isinstance(message, dict) or "role" not in message or not {"content", "tool_calls"} & message.keys():
            return f"message {number} is {one_line(repr(message), 80)}"
    return None


def record_label(source: str, index: int) -> str:
    """Where row `index` (0-based, as loaded by `load_rows(source)`) is, as people count: `line N` of a `.jsonl`
    file (1-based, blank lines counted), `record N` (1-based) of anything else (.json, .parquet, built-in)."""
    path = Path(source)
    if path.suffix.lower() == ".jsonl" and path.is_file():
        # Read again on this (error) path only, so rows need not carry their line numbers.
        with path.open(encoding="utf-8") as handle:
            non_blank = (number for number, line in enumerate(handle, start=1) if line.strip())
            number = next(itertools.islice(non_blank, index, None), None)
        if number is not None:
            return f"line {number}"
    return f"record {index + 1}"
