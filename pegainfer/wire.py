"""The wire format of every message: a msgpack array ``[tag, field_0, field_1, ...]``.

A message is a dataclass registered with ``@message(tag)``; a nested record (a non-message
dataclass) is an array of its fields. ``decode`` checks the tag, the field count and the basic
type of every field, and raises ``ProtocolError`` on anything malformed.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any, Union

import msgpack

MAX_MESSAGE_BYTES = 256 * 1024 * 1024


class ProtocolError(ValueError):
    """A message that could not be decoded or failed validation."""


_TAG_TO_TYPE: dict[int, type] = {}
_TYPE_TO_TAG: dict[type, int] = {}


def message(tag: int):
    def register(cls: type) -> type:
        if tag in _TAG_TO_TYPE:
            raise RuntimeError(f"message tag {tag} used twice")
        _TAG_TO_TYPE[tag] = cls
        _TYPE_TO_TAG[cls] = tag
        return cls

    return register


# Each record type gets an encoder and a decoder compiled once from its type hints, so the hot
# path does no reflection: a step of 256 requests is encoded and checked in well under 1 ms.

Encoder = Callable[[Any], Any]
Decoder = Callable[[Any, str], Any]

_ENCODERS: dict[type, Encoder] = {}
_DECODERS: dict[type, Decoder] = {}


def _identity(value: Any) -> Any:
    return value


def _field_encoder(hint: Any) -> Encoder:
    origin = typing.get_origin(hint)
    if origin is Union or origin is types.UnionType:
        options = [o for o in typing.get_args(hint) if o is not type(None)]
        if len(options) == 1:
            inner = _field_encoder(options[0])
            if inner is _identity:
                return _identity
            return lambda value: None if value is None else inner(value)
        return _identity
    if origin is list:
        (item_hint,) = typing.get_args(hint) or (Any,)
        item = _field_encoder(item_hint)
        if item is _identity:
            return list
        return lambda value: [item(v) for v in value]
    if dataclasses.is_dataclass(hint):
        return _record_encoder(hint)
    return _identity


def _record_encoder(cls: type) -> Encoder:
    encoder = _ENCODERS.get(cls)
    if encoder is None:
        fields_ = [(f.name, _field_encoder(h)) for f, h in _typed_fields(cls)]

        def encoder(obj: Any) -> list[Any]:
            return [enc(getattr(obj, name)) for name, enc in fields_]

        _ENCODERS[cls] = encoder
    return encoder


def _typed_fields(cls: type) -> list[tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls)]


def encode(msg: Any) -> bytes:
    cls = type(msg)
    tag = _TYPE_TO_TAG.get(cls)
    if tag is None:
        raise ProtocolError(f"{cls.__name__} is not a registered message")
    return msgpack.packb([tag, *_record_encoder(cls)(msg)], use_bin_type=True)


_PRIMITIVES: dict[type, tuple[type, ...]] = {
    int: (int,),
    float: (float, int),
    str: (str,),
    bytes: (bytes,),
    bool: (bool,),
}


def _primitive_decoder(hint: type) -> Decoder:
    accepted = _PRIMITIVES.get(hint)
    if accepted is None:
        raise TypeError(f"unsupported field type {hint!r}")
    name = hint.__name__

    def decode_primitive(value: Any, where: str) -> Any:
        if type(value) is hint:  # the common case, checked first
            return value
        if not isinstance(value, accepted) or (hint is int and isinstance(value, bool)):
            raise ProtocolError(f"{where}: expected {name}, got {type(value).__name__}")
        return float(value) if hint is float else value

    return decode_primitive


def _field_decoder(hint: Any) -> Decoder:
    origin = typing.get_origin(hint)
    if origin is Union or origin is types.UnionType:
        options = [_field_decoder(o) for o in typing.get_args(hint) if o is not type(None)]
        nullable = type(None) in typing.get_args(hint)

        def decode_union(value: Any, where: str) -> Any:
            if value is None and nullable:
                return None
            errors = []
            for option in options:
                try:
                    return option(value, where)
                except ProtocolError as exc:
                    errors.append(str(exc))
            raise ProtocolError("; ".join(errors) or f"{where}: null is not allowed")

        return decode_union
    if hint is Any:
        return lambda value, where: value
    if origin is list:
        (item_hint,) = typing.get_args(hint) or (Any,)
        item = _field_decoder(item_hint)

        def decode_list(value: Any, where: str) -> list[Any]:
            if not isinstance(value, list):
                raise ProtocolError(f"{where}: expected a list, got {type(value).__name__}")
            return [item(v, where) for v in value]

        return decode_list
    if origin is dict or hint is dict:

        def decode_map(value: Any, where: str) -> dict:
            if not isinstance(value, dict):
                raise ProtocolError(f"{where}: expected a map, got {type(value).__name__}")
            return value

        return decode_map
    if dataclasses.is_dataclass(hint):
        return _record_decoder(hint)
    return _primitive_decoder(hint)


def _record_decoder(cls: type) -> Decoder:
    decoder = _DECODERS.get(cls)
    if decoder is None:
        fields_ = [
            (f.name, f"{cls.__name__}.{f.name}", _field_decoder(h)) for f, h in _typed_fields(cls)
        ]
        count = len(fields_)

        def decoder(values: Any, where: str) -> Any:
            if not isinstance(values, list) or len(values) != count:
                raise ProtocolError(f"{where}: {cls.__name__} needs {count} fields")
            return cls(
                **{name: dec(value, label) for (name, label, dec), value in zip(fields_, values)}
            )

        _DECODERS[cls] = decoder
    return decoder


def decode(data: bytes, expected: tuple[type, ...] | None = None) -> Any:
    """Decode and validate one message. ``expected`` restricts which message types a socket
    accepts; anything else raises ``ProtocolError``."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"not msgpack: {exc}") from None
    if not isinstance(raw, list) or not raw or type(raw[0]) is not int:
        raise ProtocolError("a message is an array that starts with its type tag")
    cls = _TAG_TO_TYPE.get(raw[0])
    if cls is None:
        raise ProtocolError(f"unknown message tag {raw[0]}")
    if expected is not None and cls not in expected:
        raise ProtocolError(f"{cls.__name__} is not accepted on this socket")
    return _record_decoder(cls)(raw[1:], cls.__name__)
