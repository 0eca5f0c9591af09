"""Functions named by import path in a config (reward functions, losses, advantage estimators): only paths the
user wrote are imported, nothing is looked up from data."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any, Callable


def import_callable(path: str, what: str) -> Callable[..., Any]:
    """Import `package.module.function` or `package.module:function`; a `ValueError` whose message starts with
    `what` and the path, naming what is wrong, otherwise."""
    module_name, sep, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} path {path!r} must look like 'package.module.function'")
    try:
        module = _import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{what} {path!r}: cannot import module {module_name!r} ({err})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{what} {path!r}: module {module_name!r} has no callable {attr!r}")
    return fn


def _import_module(name: str) -> Any:
    """`importlib.import_module(name)`; a top-level module found nowhere is looked for in the working directory too
    (`my_rewards.accuracy` beside the run), as `python -m` finds it: the `lit-rl` script's import path holds the
    script's own directory instead. Only a module a config names, and only when nothing installed has its name."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        cwd = os.getcwd()
        if err.name != name.split(".")[0] or cwd in sys.path or "" in sys.path:
            raise
        sys.path.append(cwd)  # for the rest of the run: the module's own imports of its siblings resolve alike
        return importlib.import_module(name)
