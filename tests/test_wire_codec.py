"""The compiled codec of pegainfer/wire.py against its definition: a message is the msgpack
array of its tag and fields, a nested record the array of its fields, a list field a list;
decoding returns exactly what the field types allow, converting an int to a float field and
refusing everything else as ProtocolError. Plus the int32 packing of token ids."""

from __future__ import annotations

import dataclasses
import random
import struct
import types
import typing
from array import array
from typing import Any, Union

import msgpack
import pytest

from pegainfer import protocol as p
from pegainfer import wire

MESSAGE_TYPES = sorted(wire._TAG_TO_TYPE.items())


def reference_fields(obj: Any) -> Any:
    """A record as the definition says it travels, by plain reflection."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        hints = typing.get_type_hints(type(obj))
        values = []
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if value is not None and _is_list(hints[f.name]):
                value = list(value)
            values.append(_reference_value(value))
        return values
    return obj


def _reference_value(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_reference_value(v) for v in value]
    return reference_fields(value)


def _is_list(hint: Any) -> bool:
    if typing.get_origin(hint) in (Union, types.UnionType):
        return any(typing.get_origin(o) is list for o in typing.get_args(hint))
    return typing.get_origin(hint) is list


def random_value(rng: random.Random, hint: Any, depth: int = 0) -> Any:
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        return random_value(rng, rng.choice(typing.get_args(hint)), depth)
    if hint is type(None):
        return None
    if hint is Any:
        return rng.choice([None, 3, "x", [1, "y"], {"k": 2.5}])
    if origin is list:
        (item,) = typing.get_args(hint) or (Any,)
        items = [random_value(rng, item, depth + 1) for _ in range(rng.randrange(3))]
        return tuple(items) if rng.random() < 0.2 else items  # a tuple travels as a list
    if origin is dict or hint is dict:
        return {rng.choice("ab"): rng.choice([1, "v", None]) for _ in range(rng.randrange(3))}
    if dataclasses.is_dataclass(hint):
        hints = typing.get_type_hints(hint)
        return hint(
            **{
                f.name: random_value(rng, hints[f.name], depth + 1)
                for f in dataclasses.fields(hint)
            }
        )
    choices = {
        int: [0, 1, -7, 2**40],
        float: [0.0, -1.5, 1e300, float("inf")],
        str: ["", "a", "héllo 🙂"],
        bytes: [b"", b"\x00\x01", p.pack_ids([1, 2, 3])],
        bool: [True, False],
    }
    return rng.choice(choices[hint])


@pytest.mark.parametrize("seed", range(40))
def test_encoding_is_the_tagged_array_of_fields(seed):
    rng = random.Random(seed)
    for tag, cls in MESSAGE_TYPES:
        msg = random_value(rng, cls)
        want = msgpack.packb([tag, *reference_fields(msg)], use_bin_type=True)
        assert wire.encode(msg) == want, cls.__name__
        decoded = wire.decode(want)
        assert type(decoded) is cls
        assert wire.encode(decoded) == want


def test_a_list_field_given_any_iterable_travels_as_a_list():
    msg = p.AbortRequests(request_ids=(f"r{i}" for i in range(3)))  # type: ignore[arg-type]
    assert wire.decode(wire.encode(msg)) == p.AbortRequests(["r0", "r1", "r2"])


def test_unserializable_values_raise_type_error():
    with pytest.raises(TypeError):
        wire.encode(p.Shutdown(reason={1, 2}))  # type: ignore[arg-type]
    with pytest.raises(p.ProtocolError):
        wire.encode(object())  # not a registered message


def _result(**changes: Any) -> list[Any]:
    fields = {"step_id": 1, "seq_ids": b"", "token_ids": b"", "error": None}
    fields.update(changes)
    return [7, *fields.values(), b"", [], b"", []]


@pytest.mark.parametrize(
    ("raw", "field", "want"),
    [
        (_result(error="boom"), "error", "boom"),
        (_result(step_id=2**40), "step_id", 2**40),
        ([11, 1, 2, 0, 3, 4, 5, 6, 7, 8, 9.5], "kv_cache_usage", 0.0),  # int to float
        ([11, 1, 2, 1, 3, 4, 5, 6, 7, 8, 9], "oldest_step_age", 9.0),
        ([15, "w", 3, 2], "seconds", 2.0),
    ],
)
def test_decoding_accepts_and_converts_as_the_field_types_say(raw, field, want):
    msg = wire.decode(msgpack.packb(raw, use_bin_type=True))
    value = getattr(msg, field)
    assert value == want and type(value) is type(want)


@pytest.mark.parametrize(
    "raw",
    [
        _result(step_id=True),  # a bool is not an int
        _result(step_id=1.0),  # nor is a float
        _result(seq_ids="text"),  # str is not bytes
        _result(error=3),
        [15, "w", 3, "2"],  # str is not a float
        [8, [["r", b"", None, 1.5, 1, 2, 3, None, None, None, None]]],  # stop reason
        [8, [["r", b"", None, None, 1, 2, 3, [1], None, None, None]]],  # a short record
        [5, ["a", 2]],  # an int in a list of str
        [1, "w", 3, ["not", "a", "map"]],
    ],
)
def test_decoding_refuses_what_the_field_types_do_not_allow(raw):
    with pytest.raises(p.ProtocolError):
        wire.decode(msgpack.packb(raw, use_bin_type=True))


def test_union_fields_keep_the_type_of_the_option_that_matched():
    for stop_reason in (5, "\n\n", None):
        raw = [8, [["r", b"", "stop", stop_reason, 1, 2, 3, None, None, None, None]]]
        (output,) = wire.decode(msgpack.packb(raw, use_bin_type=True)).outputs
        assert output.stop_reason == stop_reason and type(output.stop_reason) is type(stop_reason)


@pytest.mark.parametrize("length", [0, 1, 64, 1023, 1024, 1025, 5000])
def test_pack_ids_is_little_endian_int32_at_every_length(length):
    rng = random.Random(length)
    ids = [rng.randrange(-(2**31), 2**31) for _ in range(length)]
    packed = p.pack_ids(ids)
    assert packed == struct.pack(f"<{length}i", *ids)
    assert p.unpack_ids(packed) == ids
    assert p.pack_ids(array("i", ids)) == packed


@pytest.mark.parametrize(
    ("ids", "error"),
    [([2**31], OverflowError), ([-(2**31) - 1], OverflowError), ([1.5], TypeError)],
)
def test_pack_ids_refuses_what_is_not_int32(ids, error):
    with pytest.raises(error):
        p.pack_ids(ids)
    with pytest.raises(error):
        p.pack_ids(ids * 2000)  # past the struct-packed lengths: the same error


def test_prepare_codecs_builds_every_message_codec_ahead():
    wire._FIELD_VALUES.clear()
    wire._DECODERS.clear()
    wire.prepare_codecs()
    registered = set(wire._TAG_TO_TYPE.values())
    assert registered and registered <= set(wire._FIELD_VALUES) & set(wire._DECODERS)
    # Built ahead, they are the ones a message then uses.
    decoders = dict(wire._DECODERS)
    msg = p.AbortRequests(request_ids=["a", "b"])
    assert wire.decode(wire.encode(msg)) == msg
    assert wire._DECODERS == decoders
