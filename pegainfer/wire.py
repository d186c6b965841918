"""The wire format of every message: a msgpack array ``[tag, field_0, field_1, ...]``.

A message is a dataclass registered with ``@message(tag)``; a nested record (a non-message
dataclass) is an array of its fields. ``decode`` checks the tag, the field count and the basic
type of every field, and raises ``ProtocolError`` on anything malformed. Token ids and other
long number columns travel packed as little-endian 32-bit bytes (``pack_ids``,
``pack_floats``), never as lists of Python ints.
"""

from __future__ import annotations

import dataclasses
import operator
import struct
import sys
import types
import typing
from array import array
from collections.abc import Callable, Sequence
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
# path does no reflection. Encoding hands the whole structure to msgpack, which calls back
# (``default``) only for a record, to get its field values in one C-level attribute fetch.
# Decoding accepts a field by one exact-type test when its value needs no conversion and no
# deeper check, and runs the field's full decoder otherwise.

Decoder = Callable[[Any, str], Any]

_FIELD_VALUES: dict[type, Callable[[Any], Sequence[Any]]] = {}
_DECODERS: dict[type, Decoder] = {}


def _list_field(hint: Any) -> tuple[bool, bool]:
    """Whether the field is typed as a list (which travels as one even if the value is
    another iterable), and whether it may be None."""
    origin = typing.get_origin(hint)
    if origin is Union or origin is types.UnionType:
        options = [o for o in typing.get_args(hint) if o is not type(None)]
        if len(options) == 1 and typing.get_origin(options[0]) is list:
            return True, True
        return False, False
    return origin is list, False


def _field_values(cls: type) -> Callable[[Any], Sequence[Any]]:
    """A function from a record to its field values, in order (a tuple or a list)."""
    getter = _FIELD_VALUES.get(cls)
    if getter is not None:
        return getter
    typed = _typed_fields(cls)
    names = [f.name for f, _ in typed]
    if len(names) > 1:
        fetch = operator.attrgetter(*names)
    elif names:
        name = names[0]

        def fetch(obj: Any) -> tuple[Any, ...]:
            return (getattr(obj, name),)
    else:

        def fetch(obj: Any) -> tuple[Any, ...]:
            return ()

    # A list field holding another iterable is sent as a list; a tuple already packs as one.
    listed = []
    for index, (_, hint) in enumerate(typed):
        is_list, nullable = _list_field(hint)
        if is_list:
            listed.append((index, nullable))
    if not listed:
        getter = fetch
    else:

        def getter(obj: Any) -> Sequence[Any]:
            values = fetch(obj)
            for index, nullable in listed:
                value = values[index]
                if type(value) is not list and not (nullable and value is None):
                    values = list(values)
                    values[index] = list(value)
            return values

    _FIELD_VALUES[cls] = getter
    return getter


def _pack_record(obj: Any) -> Any:
    """msgpack's ``default``: a record (message or nested dataclass) packs as its fields."""
    getter = _FIELD_VALUES.get(type(obj))
    if getter is None:
        if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
            return obj  # msgpack refuses it then, with its own TypeError
        getter = _field_values(type(obj))
    return getter(obj)


def _typed_fields(cls: type) -> list[tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls)]


def encode(msg: Any) -> bytes:
    cls = type(msg)
    tag = _TYPE_TO_TAG.get(cls)
    if tag is None:
        raise ProtocolError(f"{cls.__name__} is not a registered message")
    return msgpack.packb([tag, *_field_values(cls)(msg)], use_bin_type=True, default=_pack_record)


_PRIMITIVES: dict[type, tuple[type, ...]] = {
    int: (int,),
    float: (float, int),
    str: (str,),
    bytes: (bytes,),
    bool: (bool,),
}
# What msgpack decodes to, for the exact-type tests.
_WIRE_TYPES = frozenset({type(None), bool, int, float, str, bytes, list, dict})


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


def _passed_types(hint: Any) -> frozenset[type]:
    """The wire types whose values the field's decoder returns unchanged after no check
    but their type: for those, a type test replaces the decoder. Every wire type for Any."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return _WIRE_TYPES
    if origin is Union or origin is types.UnionType:
        args = typing.get_args(hint)
        passed = {type(None)} if type(None) in args else set()
        # Options are tried in order: a type an earlier option takes (perhaps converting it)
        # never reaches a later one.
        taken: set[type] = set()
        for option in args:
            if option is type(None):
                continue
            passed |= _passed_types(option) - taken
            taken |= _taken_types(option)
        return frozenset(passed)
    if origin is dict or hint is dict:
        return frozenset({dict})
    if hint in _PRIMITIVES:
        return frozenset({hint})
    return frozenset()  # lists and records: their items are checked too


def _taken_types(hint: Any) -> frozenset[type]:
    """The wire types a union option may accept (so later options never see them)."""
    if hint is Any:
        return _WIRE_TYPES
    if typing.get_origin(hint) is list or dataclasses.is_dataclass(hint):
        return frozenset({list})
    if typing.get_origin(hint) is dict or hint is dict:
        return frozenset({dict})
    if hint in _PRIMITIVES:
        # isinstance: float takes int and bool too; int refuses bool explicitly.
        return frozenset(t for t in _WIRE_TYPES if issubclass(t, _PRIMITIVES[hint])) - (
            {bool} if hint is int else set()
        )
    return _WIRE_TYPES


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
        typed = _typed_fields(cls)
        # (index, the types that pass as they are, the full decoder, the label for errors)
        checks = [
            (index, passed, _field_decoder(hint), f"{cls.__name__}.{f.name}")
            for index, (f, hint) in enumerate(typed)
            if (passed := _passed_types(hint)) != _WIRE_TYPES
        ]
        count = len(typed)

        def decoder(values: Any, where: str) -> Any:
            if not isinstance(values, list) or len(values) != count:
                raise ProtocolError(f"{where}: {cls.__name__} needs {count} fields")
            # In place: ``values`` is a fresh list of the decoded message, used only here.
            for index, passed, decode_field, label in checks:
                value = values[index]
                if type(value) not in passed:
                    values[index] = decode_field(value, label)
            return cls(*values)

        _DECODERS[cls] = decoder
    return decoder


def prepare_codecs() -> None:
    """Build every registered message's encoder and decoder now, rather than at a process's
    first message of each type, inside a request's time (all of them: about 3 ms)."""
    for cls in _TAG_TO_TYPE.values():
        _field_values(cls)
        _record_decoder(cls)


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


# ---------------------------------------------------------------------------
# Packed number columns
# ---------------------------------------------------------------------------


# Lists up to this long are packed by a ``struct.Struct`` kept per length: a step's columns
# (a few per step, batch-sized) pack several times faster that way than through ``array``.
_STRUCT_PACKED_MAX = 1024
_INT32_STRUCTS: dict[int, struct.Struct] = {}


def pack_ids(ids: Any) -> bytes:
    """Pack a sequence of ints (list, array, numpy or torch int tensor on CPU) as int32 bytes."""
    if type(ids) is list and len(ids) <= _STRUCT_PACKED_MAX:
        packer = _INT32_STRUCTS.get(len(ids))
        if packer is None:
            packer = _INT32_STRUCTS[len(ids)] = struct.Struct(f"<{len(ids)}i")
        try:
            return packer.pack(*ids)
        except struct.error:
            pass  # not int32s: the array below raises its usual error
    if isinstance(ids, (bytes, bytearray)):
        return bytes(ids)
    if hasattr(ids, "numpy"):  # torch tensor on the CPU
        ids = ids.numpy()
    if hasattr(ids, "astype"):  # numpy array
        return ids.astype("<i4", copy=False).tobytes()
    packed = array("i", ids)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def unpack_ids_array(data: bytes) -> array:
    """Packed int32 ids as an int32 array (one copy of the bytes, no int object per id)."""
    return _unpacked(data, "i", "id")


def unpack_ids(data: bytes) -> list[int]:
    return unpack_ids_array(data).tolist()


def pack_floats(values: Any) -> bytes:
    """Pack a sequence of floats (list, numpy or CPU torch tensor) as little-endian float32."""
    if hasattr(values, "numpy"):
        values = values.numpy()
    if hasattr(values, "astype"):
        return values.astype("<f4", copy=False).tobytes()
    packed = array("f", values)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def unpack_floats(data: bytes) -> list[float]:
    return _unpacked(data, "f", "float").tolist()


def _unpacked(data: bytes, typecode: str, what: str) -> array:
    """Little-endian 32-bit values (``typecode`` "i" or "f") as an array of this machine's."""
    if len(data) % 4:
        raise ProtocolError(f"packed {what} buffer of {len(data)} bytes is not a multiple of 4")
    unpacked = array(typecode)
    unpacked.frombytes(data)
    if sys.byteorder != "little":
        unpacked.byteswap()
    return unpacked
