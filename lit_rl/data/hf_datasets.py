"""Rows from Hugging Face `datasets` (the extra `lit-rl[datasets]`): a `save_to_disk` directory, an `.arrow` file,
or a dataset on the hub by id, each turned into the list of row dicts lit-rl's data modules use."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Optional

from lit_rl.errors import DataError, exception_line

# A hub id: `name` or `owner/name`, then `:split` or `:config:split`. Local-looking specs (a path with a data-file
# suffix, more than one `/`, a leading `.`, `/` or `~`) are never sent to the hub.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
_DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow", ".csv", ".txt")
_OFFLINE_VALUES = ("1", "true", "yes", "on")


def looks_like_hub_id(spec: str) -> bool:
    name = spec.split(":", 1)[0]
    return bool(_HUB_ID.fullmatch(name)) and not name.lower().endswith(_DATA_SUFFIXES) and spec.count(":") <= 2


def _datasets(spec: str) -> Any:
    try:
        import datasets
    except ImportError:
        raise DataError(f'data {spec!r} is read with Hugging Face datasets: pip install "lit-rl[datasets]"') from None
    datasets.disable_progress_bars()  # one bar per split and file otherwise, for a few hundred rows
    return datasets


def rows_from_disk(directory: Path, split: Optional[str], spec: str) -> list[dict[str, Any]]:
    """The rows of a `save_to_disk` directory: a `Dataset`, or one split of a `DatasetDict`."""
    datasets = _datasets(spec)
    try:
        loaded = datasets.load_from_disk(str(directory))
    except FileNotFoundError:
        raise DataError(
            f"data {spec!r}: {directory} is a directory but not one written by Dataset.save_to_disk (use a .jsonl, "
            ".json, .parquet or .arrow file, or save the data set with save_to_disk)"
        ) from None
    return _split_rows(loaded, split, spec, f"{directory}:")


def rows_from_arrow(path: Path) -> list[dict[str, Any]]:
    """The rows of one `.arrow` file (a data set's cache file, or one shard of a `save_to_disk` directory)."""
    datasets = _datasets(str(path))
    try:
        return datasets.Dataset.from_file(str(path)).to_list()
    except Exception as err:
        raise DataError(f"data file {str(path)!r}: not a readable Arrow file ({_first_line(err)})") from None


def rows_from_hub(spec: str) -> list[dict[str, Any]]:
    """The rows of `owner/name[:split]` or `owner/name:config:split`, through `datasets.load_dataset` (which reads
    its cache first, and only its cache when `HF_HUB_OFFLINE=1`)."""
    datasets = _datasets(spec)
    parts = spec.split(":")
    name, config, split = parts[0], (parts[1] if len(parts) == 3 else None), (parts[-1] if len(parts) > 1 else None)
    try:
        loaded = datasets.load_dataset(name, config, split=split or None)
    except Exception as err:
        offline = hub_offline()
        hint = (
            "HF_HUB_OFFLINE is set, and it is not in the local datasets cache"
            if offline
            else "check the id, the network, or set HF_HUB_OFFLINE=1 to read the local cache only"
        )
        raise DataError(
            f"data {spec!r}: no local file or directory of that name, and the hub data set {name!r} could not be "
            f"loaded ({exception_line(err)}); {hint}"
        ) from None
    # With a split, `load_dataset` gave that split's `Dataset`; without, a `DatasetDict`, read by default as `train`.
    return _split_rows(loaded, None, spec, f"{name}:", default="train")


def _split_rows(
    loaded: Any, split: Optional[str], spec: str, prefix: str, default: Optional[str] = None
) -> list[dict[str, Any]]:
    """Rows of a `Dataset`, or of the split `split` of a `DatasetDict`. Only a split the user did not name
    (`split` None) falls back: to `default` when the `DatasetDict` has it, else to its only split; a named split it
    lacks is an error, so that `dir:train` never trains on a `DatasetDict` holding only `test`."""
    if not hasattr(loaded, "keys"):  # a Dataset
        if split:
            raise DataError(f"data {spec!r}: a single data set, with no splits: drop ':{split}'")
        return loaded.to_list()
    splits = list(loaded.keys())
    if split is None:
        split = default if default in splits else splits[0] if len(splits) == 1 else None
    if split in splits:
        return loaded[split].to_list()
    example = f"{prefix}{splits[0]}" if splits else prefix
    wanted = f"has no split {split!r}" if split else "has several splits"
    raise DataError(f"data {spec!r} {wanted} ({', '.join(splits)}): name one, e.g. {example!r}")


def hub_offline() -> bool:
    """Whether the hub client runs offline (`HF_HUB_OFFLINE`, as it read the variable when it was imported)."""
    try:
        from huggingface_hub import constants
    except ImportError:
        return os.environ.get("HF_HUB_OFFLINE", "").lower() in _OFFLINE_VALUES
    return bool(constants.HF_HUB_OFFLINE)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__
