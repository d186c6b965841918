"""JSON encoding and decoding for the HTTP layer: orjson when it is installed, else json."""

from __future__ import annotations

import json
from typing import Any

try:
    import orjson
except ImportError:  # pragma: no cover - depends on the environment
    orjson = None


def dumps(value: Any) -> bytes:
    if orjson is not None:
        try:
            return orjson.dumps(value)
        except TypeError:
            pass  # e.g. an int beyond 64 bits, or a lone surrogate; json copes
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "replace")


def loads(data: bytes | str) -> Any:
    """Parse a request body. Raises ValueError on malformed JSON."""
    if orjson is not None:
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise ValueError(str(exc)) from None
    return json.loads(data)
