"""Every message that crosses a process boundary, and its wire format.

A message is a dataclass registered with a numeric tag. On the wire it is a msgpack array
``[tag, field_0, field_1, ...]``; a nested record (a non-message dataclass such as
``SamplingParams``) is an array of its fields. Token ids travel packed as little-endian int32
bytes (``pack_ids``), never as lists of Python ints.

``decode`` checks the tag, the field count and the basic type of every field, and raises
``ProtocolError`` on anything malformed; receivers log and drop such a message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pegainfer.wire import (
    MAX_MESSAGE_BYTES,
    ProtocolError,
    decode,
    encode,
    message,
    pack_floats,
    pack_ids,
    unpack_floats,
    unpack_ids,
    unpack_ids_array,
)

__all__ = [
    "MAX_MESSAGE_BYTES",
    "ProtocolError",
    "decode",
    "encode",
    "message",
    "pack_floats",
    "pack_ids",
    "unpack_floats",
    "unpack_ids",
    "unpack_ids_array",
]

# ---------------------------------------------------------------------------
# Records nested inside messages
# ---------------------------------------------------------------------------


@dataclass
class StructuredOutput:
    """A constraint on what a request may generate, compiled by the scheduler into a grammar
    whose allowed next tokens mask the logits at every step.

    ``kind``: ``json`` (``spec`` is a JSON schema, serialized), ``json_object`` (any JSON
    object; ``spec`` empty), ``regex``, ``choice`` (``spec`` a JSON list of strings),
    ``grammar`` (EBNF) or ``structural_tag`` (``spec`` the tag, serialized).

    ``after_token_id``: -1 for a constraint on the whole output; otherwise it holds from the
    token after this one's first appearance in the output, the tokens up to it free (a
    reasoning model's ``</think>``: the reasoning is free, the answer constrained).
    """

    kind: str
    spec: str = ""
    after_token_id: int = -1
    # JSON without whitespace between its tokens (vLLM's disable_any_whitespace).
    compact_json: bool = False


@dataclass
class SamplingParams:
    """Per-request generation settings. Validated by the frontend before they travel."""

    max_tokens: int = 16
    # The server's ceiling on max_tokens (generation_config's max_new_tokens), applied once
    # the prompt's length is known; None: the context window alone.
    max_tokens_ceiling: int | None = None
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
    # logit_bias: added to these tokens' logits before sampling (ids ascending, each once).
    logit_bias_ids: list[int] = field(default_factory=list)
    logit_bias_values: list[float] = field(default_factory=list)
    # Only these tokens may be drawn (empty: any).
    allowed_token_ids: list[int] = field(default_factory=list)
    # vLLM's bad_words, as the frontend got them, and as the token sequences that write them
    # (the tokenizer process fills these): never written.
    bad_words: list[str] = field(default_factory=list)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    structured: StructuredOutput | None = None
    # The prefix cache shares blocks only among requests of the same salt (None: unsalted).
    cache_salt: str | None = None
    # With --scheduling-policy priority: lower runs first and is preempted last.
    priority: int = 0
    # Set by the tokenizer process: the chat prompt ends inside a think block (a template
    # that opens it for the model), so the output starts as reasoning.
    starts_in_reasoning: bool = False


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
    # A request whose constraint starts after a token (StructuredOutput.after_token_id) and
    # has not seen it: its grammar's first mask (little-endian int32 words), which the
    # sampling rank keeps for the step that may draw right after that token.
    first_mask: bytes = b""


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
    # Set on a request's first output when its text depends on them (stop strings, special
    # tokens, logprobs): the detokenizer learns them from here, in order with the tokens.
    sampling: SamplingParams | None = None
    logprobs: TokenLogprobs | None = None  # of new_token_ids, when the request asked
    prompt_logprobs: TokenLogprobs | None = None  # a span of the prompt
    # Seconds from arrival to the first admission, on the request's first output.
    queue_time: float | None = None


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
    logprobs: TokenLogprobs | None = None  # with token_bytes filled in
    prompt_logprobs: TokenLogprobs | None = None
    queue_time: float | None = None  # as on SeqOutput
    # On the first delta: the output starts inside a think block its prompt opened.
    starts_in_reasoning: bool = False


@dataclass
class TokenLogprobs:
    """Log-probabilities of consecutive tokens of one sequence, from the raw logits
    (log_softmax in float32, before temperature and penalties).

    For sampled tokens ``start`` is the index of the first one in the output; for a prompt
    span it is the prompt position of the first token (>= 1: the first prompt token has
    no logprob). ``top_ids``/``top_logprobs`` hold ``num_top`` entries per token, best first.
    ``token_bytes`` is filled by the detokenizer: the exact bytes of each token, then of each
    top token (``n + n * num_top`` entries).
    """

    start: int
    token_ids: bytes  # packed int32 [n]
    logprobs: bytes  # packed float32 [n]
    num_top: int
    top_ids: bytes  # packed int32 [n * num_top]
    top_logprobs: bytes  # packed float32 [n * num_top]
    token_bytes: list[bytes] = field(default_factory=list)
    ranks: bytes = b""  # packed int32 [n]: each token's rank in the vocabulary, 1 the likeliest


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
    tools: list[dict[str, Any]] | None = None  # for the chat template
    continue_final_message: bool = False  # the prompt ends inside the last message
    # Keep only the prompt's last this many tokens (None: all).
    truncate_prompt_tokens: int | None = None
    # Special tokens (BOS) the tokenizer adds; None: for text, not for a rendered chat.
    add_special_tokens: bool | None = None


@message(3)
@dataclass
class TokenizedRequest:
    """To the scheduler, from a tokenizer (or from the frontend, for a token-id prompt it
    checked itself): a validated request with its prompt token ids."""

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
    # Rows that sample under a grammar: their seq ids, and per id the allowed tokens as a
    # bitmask of little-endian int32 words (bit j of word i: token 32 * i + j), row after row.
    masked_seq_ids: bytes = b""  # packed int32
    token_bitmask: bytes = b""
    # The bitmask comes later, in a StepMasks for this step (to the sampling rank): a masked
    # row's token of the step before is still in flight, and its grammar needs it.
    masks_follow: bool = False
    # Sampling rows whose grammar starts after a token (its after_token_id) not yet seen,
    # and whose token of the step before is still in flight: each draws under the first
    # mask its NewSequence brought if, and only if, that token is the one.
    gated_seq_ids: bytes = b""  # packed int32
    # Tokens banned this step (bad_words): per entry a seq id, the token, and -1 or the
    # token the ban waits for (it holds only if the row's token of the step before is it).
    ban_seq_ids: bytes = b""  # packed int32
    ban_token_ids: bytes = b""
    ban_gates: bytes = b""


@message(20)
@dataclass
class StepMasks:
    """Scheduler to the sampling rank: the token bitmask of a planned step whose plan said
    ``masks_follow``, for its ``masked_seq_ids`` in order (as ``StepPlan.token_bitmask``).
    The rank runs the step's forward pass meanwhile and samples once it has these."""

    step_id: int
    masked_seq_ids: bytes  # packed int32
    token_bitmask: bytes


@message(7)
@dataclass
class StepResult:
    """Worker rank 0 to scheduler: the tokens sampled in one step."""

    step_id: int
    seq_ids: bytes  # packed int32, the sequences that sampled, in batch order
    token_ids: bytes  # packed int32
    error: str | None = None
    # Only for sequences that asked: entry i of ``logprobs`` belongs to logprob_seq_ids[i].
    logprob_seq_ids: bytes = b""  # packed int32
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprob_seq_ids: bytes = b""  # packed int32
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)


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


@message(11)
@dataclass
class EngineStats:
    """Scheduler to frontend, a few times a second while anything changes: the gauges and
    counters behind /metrics and the admission limit on waiting requests."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks held by requests
    num_preemptions: int  # totals since start from here on
    prompt_tokens_total: int
    generation_tokens_total: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_steps_in_flight: int
    oldest_step_age: float  # seconds the oldest step in flight has been running


@message(12)
@dataclass
class Drain:
    """Launcher to frontend: refuse new requests, let those in flight finish for up to
    ``timeout`` seconds, abort the rest, then answer ``Drained``."""

    timeout: float


@message(13)
@dataclass
class Drained:
    """Frontend to launcher: every request has ended; the tree may stop."""

    name: str
    num_finished: int
    num_aborted: int


@message(14)
@dataclass
class EngineDead:
    """Launcher to frontend: a process of the engine died; fail everything in flight."""

    reason: str


@message(15)
@dataclass
class WatchdogAlarm:
    """Scheduler to launcher: a step has been in flight longer than the watchdog allows."""

    name: str
    step_id: int
    seconds: float


@message(16)
@dataclass
class TokenizeRequest:
    """Frontend to tokenizer, for /tokenize: render (for ``messages``) and tokenize, nothing
    more. The answer is a TokenizeResult, or a RequestRejected."""

    request_id: str
    prompt: str | None
    messages: list[dict[str, Any]] | None
    chat_template_kwargs: dict[str, Any]
    add_generation_prompt: bool
    add_special_tokens: bool
    return_token_strs: bool
    tools: list[dict[str, Any]] | None = None  # for the chat template
    continue_final_message: bool = False


@message(17)
@dataclass
class TokenizeResult:
    """Tokenizer to frontend: the ids of a TokenizeRequest, and their vocabulary strings when
    they were asked for."""

    request_id: str
    token_ids: bytes  # packed int32
    token_strs: list[str | None] | None  # None for an id the vocabulary lacks


@message(18)
@dataclass
class DetokenizeRequest:
    """Frontend to tokenizer, for /detokenize: the text of token ids, special tokens kept.
    The answer is a DetokenizeResult, or a RequestRejected (an id out of vocabulary)."""

    request_id: str
    token_ids: bytes  # packed int32


@message(19)
@dataclass
class DetokenizeResult:
    """Tokenizer to frontend: the text of a DetokenizeRequest."""

    request_id: str
    text: str


@message(21)
@dataclass
class ResetPrefixCache:
    """Frontend to scheduler: forget every cached prefix (POST /reset_prefix_cache). The
    answer is a PrefixCacheReset."""

    request_id: str


@message(22)
@dataclass
class PrefixCacheReset:
    """Scheduler to frontend: the prefix cache is empty; blocks that running requests hold
    stay theirs, and what they compute from here on is not cached."""

    request_id: str
    enabled: bool  # false: the server runs without a prefix cache
    num_entries: int  # cached block contents forgotten
    num_blocks_freed: int  # unreferenced cached blocks returned to the free queue
