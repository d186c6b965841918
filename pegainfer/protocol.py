"""Every message that crosses a process boundary, and its wire format.

A message is a dataclass registered with a numeric tag. On the wire it is a msgpack array
``[tag, field_0, field_1, ...]``; a nested record (a non-message dataclass such as
``SamplingParams``) is an array of its fields. Token ids travel packed as little-endian int32
bytes (``pack_ids``), never as lists of Python ints.

``decode`` checks the tag, the field count and the basic type of every field, and raises
``ProtocolError`` on anything malformed; receivers log and drop such a message.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Union

import msgpack

MAX_MESSAGE_BYTES = 256 * 1024 * 1024


class ProtocolError(ValueError):
    """A message that could not be decoded or failed validation."""


# ---------------------------------------------------------------------------
# Packed token ids
# ---------------------------------------------------------------------------


def pack_ids(ids: Any) -> bytes:
    """Pack a sequence of ints (list, array, numpy or torch int tensor on CPU) as int32 bytes."""
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


def unpack_ids(data: bytes) -> list[int]:
    if len(data) % 4:
        raise ProtocolError(f"packed id buffer of {len(data)} bytes is not a multiple of 4")
    unpacked = array("i")
    unpacked.frombytes(data)
    if sys.byteorder != "little":
        unpacked.byteswap()
    return unpacked.tolist()


# ---------------------------------------------------------------------------
# Records nested inside messages
# ---------------------------------------------------------------------------


@dataclass
class SamplingParams:
    """Per-request generation settings. Validated by the frontend before they travel."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    min_p: float = 0.0
    seed: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # number of top logprobs per sampled token; None: off
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True


@dataclass
class NewSequence:
    """A sequence the workers have not seen: its tokens so far and its sampling settings.

    Sent once. A preempted sequence comes back as a new one carrying its prompt plus what it
    had generated, so that the worker recomputes its KV cache.
    """

    seq_id: int
    token_ids: bytes  # packed int32
    sampling: SamplingParams
    num_prompt_tokens: int


@dataclass
class BlockTableUpdate:
    """Physical KV block ids appended to one sequence's block table this step."""

    seq_id: int
    block_ids: bytes  # packed int32


@dataclass
class SeqOutput:
    """New tokens of one request in one step, scheduler to detokenizer."""

    request_id: str
    new_token_ids: bytes  # packed int32
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None  # the stop token id or stop string that matched
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass
class TextDelta:
    """New text of one request, detokenizer to frontend."""

    request_id: str
    text: str
    token_ids: bytes  # packed int32: the tokens this text came from
    finish_reason: str | None
    stop_reason: int | str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


# ---------------------------------------------------------------------------
# Messages
# ---------------------------------------------------------------------------

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


@message(1)
@dataclass
class ProcessReady:
    """A child tells the launcher it has finished starting. ``info`` carries what it learned
    at start that others need (for a worker: the number of KV blocks)."""

    name: str
    pid: int
    info: dict[str, Any] = field(default_factory=dict)


@message(2)
@dataclass
class GenerateRequest:
    """Frontend to tokenizer: one request to tokenize, validate and pass to the scheduler."""

    request_id: str
    prompt: str | None
    prompt_token_ids: bytes | None
    messages: list[dict[str, Any]] | None
    chat_template_kwargs: dict[str, Any]
    add_generation_prompt: bool
    sampling: SamplingParams
    arrival_time: float


@message(3)
@dataclass
class TokenizedRequest:
    """Tokenizer to scheduler: a validated request with its prompt token ids."""

    request_id: str
    prompt_token_ids: bytes  # packed int32
    sampling: SamplingParams
    arrival_time: float


@message(4)
@dataclass
class RequestRejected:
    """A request refused after it left the frontend (by a tokenizer or the scheduler)."""

    request_id: str
    status: int
    message: str
    error_type: str
    param: str | None
    code: str | None


@message(5)
@dataclass
class AbortRequests:
    """Frontend to scheduler: stop these requests and free their state."""

    request_ids: list[str]


@message(6)
@dataclass
class StepPlan:
    """Scheduler to every worker rank: one forward step.

    The batch is ``seq_ids`` in order. Sequence i has ``num_computed[i]`` tokens in its KV
    cache already and processes ``num_scheduled[i]`` more this step. A worker samples a token
    for every sequence whose computed tokens reach its known length after the step.
    ``finished_seq_ids`` are dropped (and their state freed) before the step runs.
    """

    step_id: int
    new_seqs: list[NewSequence]
    seq_ids: bytes  # packed int32
    num_computed: bytes  # packed int32
    num_scheduled: bytes  # packed int32
    block_updates: list[BlockTableUpdate]
    finished_seq_ids: bytes  # packed int32


@message(7)
@dataclass
class StepResult:
    """Worker rank 0 to scheduler: the tokens sampled in one step."""

    step_id: int
    seq_ids: bytes  # packed int32, the sequences that sampled, in batch order
    token_ids: bytes  # packed int32
    error: str | None = None


@message(8)
@dataclass
class TokenOutputs:
    """Scheduler to detokenizer: every request's new tokens of one step."""

    outputs: list[SeqOutput]


@message(9)
@dataclass
class TextOutputs:
    """Detokenizer to frontend: every request's new text of one step."""

    outputs: list[TextDelta]


@message(10)
@dataclass
class Shutdown:
    """Launcher to a child: exit cleanly."""

    reason: str


# ---------------------------------------------------------------------------
# Encoding
# ---------------------------------------------------------------------------

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
