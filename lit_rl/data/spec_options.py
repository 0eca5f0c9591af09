"""The options of a data spec (`reasoning_gym:<task>?size=8&seed=1`, `verifiers:<taskset>?select.limit=8`): the
`key=value` pairs after its `?`."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import parse_qsl

from lit_rl.errors import DataError


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def query_options(spec: str, query: str) -> dict[str, Any]:
    """The options after a data spec's `?` (`key=value&...`, each value read as JSON where it parses); a one-line
    `DataError` naming `spec` when they cannot be read or a key is given twice."""
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise DataError(f"{spec!r}: options go as key=value pairs joined by '&' after '?'") from None
    options: dict[str, Any] = {}
    for key, value in pairs:
        if key in options:
            raise DataError(f"{spec!r}: option {key!r} is given twice")
        options[key] = _value(value)
    return options
