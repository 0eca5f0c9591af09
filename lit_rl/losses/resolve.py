"""A built-in function by name, or a user's by import path (`--model.loss.objective`, `--model.loss.advantage`)."""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, TypeVar

import torch

from lit_rl.errors import ConfigError, LitRLError, UserFunctionError, exception_line
from lit_rl.importing import import_callable

F = TypeVar("F", bound=Callable)


def resolve_function(
    key: str, name: str, registry: dict[str, F], check: Optional[Callable[[tuple, Any], Optional[str]]] = None
) -> F:
    """`registry[name]`, or the function at import path `name` (it contains a dot or a colon); a one-line
    `ConfigError` naming `key` and the choices otherwise. A user's function is called through `NamedFailures`:
    what it raises, or a result `check(args, result)` finds wrong, is one line naming `key` and `name`."""
    if name in registry:
        return registry[name]
    if "." not in name and ":" not in name:
        raise ConfigError(f"{key} must be one of {sorted(registry)} or an import path, got {name!r}")
    try:
        found = import_callable(name, key)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return NamedFailures(found, f"{key} {name!r}", check)  # type: ignore[return-value]


def tensor_pair_problem(result: Any, first: str) -> Optional[str]:
    """What is wrong with a user's function's result where a `(tensor, stats dict)` pair is due (`first` names the
    tensor): None if it is one."""
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.Tensor):
        return None
    return f"returned {type(result).__name__}, not ({first} tensor, stats dict)"


class NamedFailures:
    """A user's function `fn`, whose exceptions (a wrong signature, a shape error inside it) and wrong results
    (`check`'s message) become a one-line `UserFunctionError` naming it: without it the user saw a 100-line
    traceback ending in lit-rl's code, where the result was first used. An object, not a closure, so that a module
    holding it pickles as it did with the plain function (`ddp_spawn`) when `fn` and `check` do."""

    def __init__(self, fn: Callable, named: str, check: Optional[Callable[[tuple, Any], Optional[str]]]) -> None:
        self.fn, self.named, self.check = fn, named, check
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            result = self.fn(*args, **kwargs)
        except (LitRLError, torch.OutOfMemoryError):  # out of memory is the batch's size, not the function's fault
            raise
        except Exception as err:
            raise UserFunctionError(f"{self.named} raised {exception_line(err)}") from err
        wrong = self.check(args, result) if self.check is not None else None
        if wrong:
            raise UserFunctionError(f"{self.named} {wrong}")
        return result
