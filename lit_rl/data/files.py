"""Rows from local files (JSONL, JSON, parquet), Hugging Face `datasets` (a `save_to_disk` directory, an `.arrow`
file, a hub id), built-in tasks (`builtin:<task>/<split>`), reasoning-gym's tasks (`reasoning_gym:<task>?...`) or a
verifiers taskset's (`verifiers:<taskset>?...`)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any, Sequence

from lit_rl.data import hf_datasets
from lit_rl.data.arithmetic import BUILTIN_DATASETS
from lit_rl.data.reasoning_gym import is_reasoning_gym, load_reasoning_gym_rows
from lit_rl.data.verifiers_tasksets import is_verifiers, load_verifiers_rows
from lit_rl.errors import DataError, DataFileNotFound

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
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise DataError(f"{path}: line {err.lineno}: malformed JSON ({err.msg})") from None
        if isinstance(data, dict):  # column-oriented {"prompt": [...], ...}
            keys = list(data)
            data = [dict(zip(keys, values)) for values in zip(*(data[k] for k in keys))]
        if not isinstance(data, list):
            raise DataError(f"{spec}: expected a list of rows or a dict of columns")
        return data
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    raise DataError(
        f"data file {spec!r}: unsupported extension {suffix!r} (use .jsonl, .json, .parquet, .arrow or a "
        "datasets directory)"
    )


def _read_jsonl(path: Path) -> list[Row]:
    rows = []
    with path.open() as handle:
        for line_number, line in enumerate(handle, start=1):
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


def validate_rows(rows: Sequence[Row], required: Sequence[str], source: str) -> None:
    """Fail on an empty data set or a row missing a required column (naming its line or record, see
    `record_label`)."""
    if not rows:
        raise DataError(f"{source}: the data set is empty")
    for index, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"{source}: {record_label(source, index)} must be an object with named columns")
        for column in required:
            value = row.get(column)
            if value is None:
                raise DataError(f"{source}: {record_label(source, index)} has no {column!r} column")
            if not isinstance(value, (str, list)):
                raise DataError(
                    f"{source}: {record_label(source, index)} column {column!r} must be text or chat messages"
                )


def record_label(source: str, index: int) -> str:
    """Where row `index` (0-based, as loaded by `load_rows(source)`) is, as people count: `line N` of a `.jsonl`
    file (1-based, blank lines counted), `record N` (1-based) of anything else (.json, .parquet, built-in)."""
    path = Path(source)
    if path.suffix.lower() == ".jsonl" and path.is_file():
        # Read again on this (error) path only, so rows need not carry their line numbers.
        with path.open() as handle:
            non_blank = (number for number, line in enumerate(handle, start=1) if line.strip())
            number = next(itertools.islice(non_blank, index, None), None)
        if number is not None:
            return f"line {number}"
    return f"record {index + 1}"
