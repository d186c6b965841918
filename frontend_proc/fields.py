"""Typed readers for the fields of a JSON request body.

Each reader returns the default when the field is absent or null (OpenAI clients send
``null`` for "not given"), and raises a 400 ``APIError`` naming the field otherwise.
JSON booleans are Python ints, so every integer reader rejects them explicitly.
"""

from __future__ import annotations

import math
from typing import Any, TypeVar

from frontend_proc.errors import invalid
from pegainfer.protocol import SamplingParams

T = TypeVar("T")

# Token counts and ids travel as int32 on the hot paths; nothing larger is meaningful.
MAX_INT32 = 2**31 - 1
# Seeds travel as msgpack ints; keep them in the signed 64-bit range.
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _type_name(value: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array"}.get(
        type(value), "object" if isinstance(value, dict) else type(value).__name__
    )


def get_int(
    body: dict[str, Any],
    name: str,
    default: T,
    lo: int | None = None,
    hi: int | None = None,
) -> int | T:
    value = body.get(name)
    if value is None:
        return default
    # 16.0 from a client that only has floats is still a whole number.
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not is_int(value):
        raise invalid(f"'{name}' must be an integer, got {_type_name(value)}", name)
    if lo is not None and value < lo:
        raise invalid(f"'{name}' must be at least {lo}, got {value}", name)
    if hi is not None and value > hi:
        raise invalid(f"'{name}' must be at most {hi}, got {value}", name)
    return value


def get_float(
    body: dict[str, Any],
    name: str,
    default: T,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
) -> float | T:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(f"'{name}' must be a number, got {_type_name(value)}", name)
    value = float(value)
    # Python's json module accepts NaN and Infinity, which would slip past range checks.
    if not math.isfinite(value):
        raise invalid(f"'{name}' must be a finite number", name)
    if lo is not None and (value <= lo if lo_open else value < lo):
        bound = "greater than" if lo_open else "at least"
        raise invalid(f"'{name}' must be {bound} {lo}, got {value}", name)
    if hi is not None and value > hi:
        raise invalid(f"'{name}' must be at most {hi}, got {value}", name)
    return value


def get_bool(body: dict[str, Any], name: str, default: T) -> bool | T:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(f"'{name}' must be a boolean, got {_type_name(value)}", name)
    return value


def get_str(body: dict[str, Any], name: str, default: T) -> str | T:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, str):
        raise invalid(f"'{name}' must be a string, got {_type_name(value)}", name)
    return value


def get_object(body: dict[str, Any], name: str) -> dict[str, Any] | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid(f"'{name}' must be an object, got {_type_name(value)}", name)
    return value


def get_int_list(body: dict[str, Any], name: str, lo: int = 0, hi: int = MAX_INT32) -> list[int]:
    value = body.get(name)
    if value is None:
        return []
    if not isinstance(value, list) or not all(is_int(item) for item in value):
        raise invalid(f"'{name}' must be a list of integers", name)
    for item in value:
        if item < lo or item > hi:
            raise invalid(f"'{name}' holds {item}, outside [{lo}, {hi}]", name)
    return list(value)


# A bias at or beyond these bounds already bans or forces a token (OpenAI's range).
MAX_LOGIT_BIAS = 100.0


def get_logit_bias(body: dict[str, Any]) -> tuple[list[int], list[float]]:
    """``logit_bias``, an object of token id (a decimal string, as JSON keys are) to a bias
    in [-100, 100]: its ids ascending and their biases."""
    value = body.get("logit_bias")
    if value is None:
        return [], []
    if not isinstance(value, dict):
        raise invalid(
            f"'logit_bias' must be an object of token ids to biases, got {_type_name(value)}",
            "logit_bias",
        )
    biases: dict[int, float] = {}
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise invalid(f"'logit_bias' key {key!r} is not a token id", "logit_bias")
        token_id = int(key)
        if token_id > MAX_INT32:
            raise invalid(f"'logit_bias' key {key!r} is not a token id", "logit_bias")
        if token_id in biases:
            raise invalid(f"'logit_bias' names token {token_id} twice", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise invalid(f"'logit_bias' of token {key} must be a number", "logit_bias")
        if abs(bias) > MAX_LOGIT_BIAS:
            raise invalid(
                f"'logit_bias' of token {key} must be in [-100, 100], got {bias}", "logit_bias"
            )
        biases[token_id] = float(bias)
    ids = sorted(biases)
    return ids, [biases[token_id] for token_id in ids]


def check_token_ids(ids: list[int], vocab_size: int | None, param: str) -> None:
    """Every id must name a token; without a known vocabulary, it must at least be packable
    as int32 (ids travel packed)."""
    hi = vocab_size if vocab_size is not None else MAX_INT32 + 1
    if not ids or (min(ids) >= 0 and max(ids) < hi):
        return
    for token_id in ids:
        if token_id < 0 or token_id >= hi:
            size = f" (the vocabulary has {vocab_size} ids)" if vocab_size is not None else ""
            raise invalid(f"token id {token_id} is out of vocabulary{size}", param)


def check_sampling_token_ids(sampling: SamplingParams, vocab_size: int | None) -> None:
    """Every token id a request's sampling names must name a token."""
    check_token_ids(sampling.stop_token_ids, vocab_size, "stop_token_ids")
    check_token_ids(sampling.logit_bias_ids, vocab_size, "logit_bias")
    check_token_ids(sampling.allowed_token_ids, vocab_size, "allowed_token_ids")


def get_stop(body: dict[str, Any]) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise invalid("'stop' must be a string or a list of strings", "stop")
    # An empty stop string would end every request at once; an empty list is a client bug.
    if not value or any(item == "" for item in value):
        raise invalid("'stop' must not be empty or hold an empty string", "stop")
    return list(value)


def type_name(value: Any) -> str:
    return _type_name(value)
