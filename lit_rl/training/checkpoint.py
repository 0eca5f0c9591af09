"""Atomic checkpoint writes: a checkpoint file or directory is either the complete new one or absent, never
half-written."""

from __future__ import annotations

import ctypes
import os
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from lit_rl.errors import exception_chain


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
            _fsync(path.parent)  # the rename itself survives a crash
        except Exception as err:
            named = _naming(err, path)
            if named is err:
                raise
            raise named from err
        finally:
            tmp.unlink(missing_ok=True)


def _naming(err: Exception, path: Path) -> Exception:
    """`err` as an OSError naming the checkpoint `path` where an OS error (no space, no permission) is behind it:
    torch's writer reports a full disk as `RuntimeError: ... unexpected pos`, its OSError only the context."""
    cause = next((c for c in exception_chain(err) if isinstance(c, OSError) and c.errno is not None), None)
    return err if cause is None else OSError(cause.errno, os.strerror(cause.errno), str(path))


# Checkpoint directories (DeepSpeed writes one per checkpoint, a shard per rank): every rank writes into the
# temporary sibling `temporary_directory(path)`, then one rank calls `publish_directory` once all have finished.
TEMPORARY_SUFFIX = ".tmp"
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def temporary_directory(path: Path) -> Path:
    """Where a checkpoint directory `path` is written before it is published: `.<name>.tmp` beside it."""
    return path.with_name(f".{path.name}{TEMPORARY_SUFFIX}")


def remove_stale_temporaries(directory: Path) -> None:
    """Remove the temporary checkpoint directories an interrupted save left in `directory` (any name)."""
    for stale in directory.glob(f".*{TEMPORARY_SUFFIX}"):
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)


def publish_directory(tmp: Path, path: Path) -> None:
    """Make the complete directory `tmp` appear as `path` in one step: fsync every file and directory in it, then
    rename it to `path`, replacing what was there (a directory, a file, or a symlink such as `last.ckpt`).

    The replacement is an atomic exchange (Linux `renameat2(RENAME_EXCHANGE)`) followed by removing the old one
    from the temporary name. Where the filesystem cannot exchange, the old one is moved to `.<name>.old` first:
    a crash between the two renames then leaves it there, whole, for recovery by hand.
    """
    _fsync_tree(tmp)
    if not os.path.lexists(path):
        os.rename(tmp, path)
    elif _exchange(tmp, path):
        _remove(tmp)  # now the old checkpoint
    else:
        aside = path.with_name(f".{path.name}.old")
        _remove(aside)
        os.rename(path, aside)
        os.rename(tmp, path)
        _remove(aside)
    _fsync(path.parent)


def remove_directory(path: Path) -> None:
    """Remove a checkpoint directory so that it never exists half-removed under its name: rename it to its
    temporary name first (a crash then leaves a stale temporary, removed by the next save)."""
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
        return
    tmp = temporary_directory(path)
    _remove(tmp)
    os.rename(path, tmp)
    _fsync(path.parent)
    shutil.rmtree(tmp)


def _exchange(a: Path, b: Path) -> bool:
    """Swap the paths `a` and `b` atomically; False where the platform or filesystem cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    return renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def _fsync_tree(root: Path) -> None:
    for directory, _, files in os.walk(root):
        for name in files:
            _fsync(Path(directory) / name)
        _fsync(Path(directory))


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
