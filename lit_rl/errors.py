"""Errors caused by what the user wrote (a config value, a data file, a reward function, a model path).

The CLI prints them as one line, `lit-rl: error: <message>`, and exits non-zero without a traceback
(`LIT_RL_TRACEBACK=1` shows it). Every message names the offending key, file, row or function. They subclass
`ValueError` (and `FileNotFoundError` where a path is missing) so library callers can catch the usual types.
"""

from __future__ import annotations

import argparse
import errno
import os
from pathlib import Path
from typing import NoReturn, Optional


class LitRLError(ValueError):
    """A mistake in the input, reported in one line."""


class ConfigError(LitRLError):
    """An impossible configuration value; the message starts with the key (`model.loss.beta ...`)."""


class DataError(LitRLError):
    """A data file or row that cannot be used; the message names the file and row."""


class DataFileNotFound(DataError, FileNotFoundError):
    """A data file that does not exist."""


class ModelNotFound(LitRLError, FileNotFoundError):
    """A model path or built-in model name that does not exist."""


class RewardFunctionError(LitRLError):
    """A reward function that does not import, raises, or returns the wrong values; the message names it."""


class UserFunctionError(LitRLError):
    """A user's function given by import path (an objective, an advantage estimator) raised or returned what its
    caller cannot use; the message names its key and path."""


class EnvironmentStepError(LitRLError):
    """A user's environment raised when built, in `reset` or in `step`, or returned something the protocol does not
    allow."""


class BrokenInstall(LitRLError):
    """An installed package that cannot work with this environment; the message says how to fix it."""


class ReportedOnRankZero(LitRLError):
    """Raised on the other ranks of a multi-process run when one rank failed: rank 0 reports the failure (with the
    rank it happened on) in one line, and these ranks exit with the same code without a line of their own."""


def one_line(value: object, limit: int | None = None) -> str:
    """`value`'s text with every run of white space (new lines included) made one space, cut to `limit` characters:
    how an error from a library, a server or a parser becomes part of lit-rl's one-line messages."""
    return " ".join(str(value).split())[:limit]


def exception_line(err: BaseException) -> str:
    """An exception as `Type: the first line of its message` (the type alone without one): a library's error as
    part of a one-line message."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse for `lit-rl check` and `lit-rl export`: a bad command line is one line naming where the usage is
    (argparse prints the whole usage text first), exit 2 as argparse's."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def exception_chain(err: BaseException) -> list[BaseException]:
    """`err` and the exceptions it was raised from or during, innermost last."""
    seen: set[int] = set()
    chain: list[BaseException] = []
    current: Optional[BaseException] = err
    while current is not None and id(current) not in seen:
        chain.append(current)
        seen.add(id(current))
        current = current.__cause__ if current.__suppress_context__ else (current.__cause__ or current.__context__)
    return chain


def refuse_unwritable_folder(folder: Path, what: str) -> None:
    """An `OSError` naming `folder` (the CLI's one line: `<folder>: <why>`) unless this process could make it or
    write in it: the nearest existing folder on its path must be a folder it can write in. Nothing is made (a new
    folder would count as another run's files where run folders are checked)."""
    existing = next(p for p in (folder, *folder.parents) if os.path.lexists(p))
    if not existing.is_dir():
        raise OSError(errno.ENOTDIR, f"{os.strerror(errno.ENOTDIR)}: cannot write {what} there", str(folder))
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OSError(errno.EACCES, f"cannot write {what} there", str(folder))
