"""JSON encoding and decoding for the HTTP layer: orjson when it is installed, else json."""

from __future__ import annotations

import json
import re
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


# A \uD800-\uDFFF escape: half of a UTF-16 pair, or a lone surrogate if nothing pairs it.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def loads(data: bytes | str) -> Any:
    """Parse a request body. Raises ValueError on malformed JSON, and on a string holding a
    lone surrogate (``"\\ud800"``), which has no UTF-8 form for the tokenizer or the wire."""
    if orjson is not None:
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise ValueError(str(exc)) from None
    try:
        value = json.loads(data)
    except RecursionError:
        raise ValueError("arrays or objects nest too deeply") from None
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    if _may_hold_surrogates(raw):
        _reject_lone_surrogates(value, "")
    return value


def _may_hold_surrogates(raw: bytes) -> bool:
    """False where no string of the parsed body can hold a surrogate: the bytes are valid
    UTF-8 (``json`` would take encoded surrogates too) and escape none."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return _SURROGATE_ESCAPE.search(raw) is not None


def _reject_lone_surrogates(value: Any, path: str) -> None:
    # A stack, not recursion: the body may nest as deep as the parser let it.
    pending = [(value, path)]
    while pending:
        item, where = pending.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                place = f" at {where}" if where else ""
                raise ValueError(
                    f"the string{place} holds a lone surrogate (U+{ord(item[exc.start]):04X}), "
                    "which is not Unicode"
                ) from None
        elif isinstance(item, dict):
            for key, member in item.items():
                pending.append((key, where))
                pending.append((member, f"{where}.{key}" if where else key))
        elif isinstance(item, list):
            pending.extend((member, f"{where}[{index}]") for index, member in enumerate(item))
