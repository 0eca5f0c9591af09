"""Functions named by import path in a config (reward functions, losses, advantage estimators): only paths the
user wrote are imported, nothing is looked up from data."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

from lit_rl.errors import exception_line


def import_callable(path: str, what: str) -> Callable[..., Any]:
    """Import `package.module.function` or `package.module:function`; a `ValueError` whose message starts with
    `what` and the path, naming what is wrong, otherwise."""
    module_name, sep, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} path {path!r} must look like 'package.module.function'")
    try:
        module = import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{what} {path!r}: cannot import module {module_name!r} ({err})") from None
    except Exception as err:  # the module's own code failed (a SyntaxError names its file and line itself)
        where = "" if isinstance(err, SyntaxError) else _where(err)
        raise ValueError(
            f"{what} {path!r}: importing module {module_name!r} raised {exception_line(err)}{where}"
        ) from err
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{what} {path!r}: module {module_name!r} has no callable {attr!r}")
    return fn


def _where(err: BaseException) -> str:
    """` (at file:line)` of the innermost frame `err` was raised in: the user's module, or one it imports."""
    frames = traceback.extract_tb(err.__traceback__)
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def import_module(name: str) -> Any:
    """`importlib.import_module(name)`; a top-level module found nowhere is looked for in the working directory too
    (`my_rewards.accuracy` beside the run), as `python -m` finds it: the `lit-rl` script's import path holds the
    script's own directory instead. Only a module a config names, and only when nothing installed has its name.

    The module is loaded from its file alone: the working directory is never added to `sys.path`, so a file there
    that shares an installed package's name (a `datasets.py` beside the run) cannot replace that package for the
    rest of the run. A package's own submodules resolve (`my_pkg.rewards.accuracy`); a plain module that imports
    a sibling file needs `PYTHONPATH=.`."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        top = name.split(".")[0]
        if err.name != top or os.getcwd() in sys.path or "" in sys.path:
            raise
        _load_from_working_directory(top, err)
        return importlib.import_module(name)


def working_directory_source(top: str) -> Optional[Path]:
    """The working directory's `top/__init__.py` or `top.py`, the file module or package `top` would load from
    there; None when neither exists."""
    package = Path.cwd() / top / "__init__.py"
    location = package if package.is_file() else Path.cwd() / f"{top}.py"
    return location if location.is_file() else None


def _load_from_working_directory(top: str, not_found: ModuleNotFoundError) -> None:
    """Load module or package `top` from the working directory's `top.py` or `top/__init__.py` into `sys.modules`;
    `not_found` re-raised when neither exists."""
    location = working_directory_source(top)
    if location is None:
        raise not_found
    package = location.name == "__init__.py"
    spec = importlib.util.spec_from_file_location(
        top, location, submodule_search_locations=[str(location.parent)] if package else None
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[top] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[top]
        raise
