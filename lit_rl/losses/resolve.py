"""A built-in function by name, or a user's by import path (`--model.loss.objective`, `--model.loss.advantage`)."""

from __future__ import annotations

from typing import Callable, TypeVar

from lit_rl.errors import ConfigError
from lit_rl.importing import import_callable

F = TypeVar("F", bound=Callable)


def resolve_function(key: str, name: str, registry: dict[str, F]) -> F:
    """`registry[name]`, or the function at import path `name` (it contains a dot or a colon); a one-line
    `ConfigError` naming `key` and the choices otherwise."""
    if name in registry:
        return registry[name]
    if "." not in name and ":" not in name:
        raise ConfigError(f"{key} must be one of {sorted(registry)} or an import path, got {name!r}")
    try:
        return import_callable(name, key)
    except ValueError as err:
        raise ConfigError(str(err)) from None
