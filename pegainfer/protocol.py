"""Every message that crosses a process boundary, and its wire format.

A message is a dataclass registered with a numeric tag. On the wire it is a msgpack array
``[tag, field_0, field_1, ...]``; a nested record (a non-message dataclass such as
``SamplingParams``) is an array of its fields. Token ids travel packed as little-endian int32
bytes (``pack_ids``), never as lists of Python ints.

``decode`` checks the tag, the field count and the basic type of every field, and raises
``ProtocolError`` on anything malformed; receivers log and drop such a message.
"""

from __future__ import annotations

import sys
from array import array
from dataclasses import dataclass, field
from typing import Any

from pegainfer.wire import MAX_MESSAGE_BYTES, ProtocolError, decode, encode, message

__all__ = ["MAX_MESSAGE_BYTES", "ProtocolError", "decode", "encode", "message"]

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
