"""Atomic checkpoint writes: a checkpoint file is either the complete new one or absent, never half-written."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes `path` as a temporary file in the same directory, fsyncs it, then renames it over `path`.

    A process killed in the middle of a save (SIGKILL, power loss) leaves every earlier checkpoint intact and at
    worst a `.<name>.tmp-<pid>` file, which the next save in that directory removes. Remote (fsspec URL) paths
    fall back to Lightning's writer.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        if "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        for stale in path.parent.glob(f".{path.name}.tmp-*"):
            stale.unlink(missing_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as handle:
                torch.save(checkpoint, handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
            directory = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(directory)  # the rename itself survives a crash
            finally:
                os.close(directory)
        finally:
            tmp.unlink(missing_ok=True)
