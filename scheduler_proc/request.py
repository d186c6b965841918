"""The scheduler's view of one request."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from pegainfer.protocol import SamplingParams, SeqOutput, pack_ids

if TYPE_CHECKING:
    from scheduler_proc.prefix_cache import PrefixNode

_pack_one_id = struct.Struct("<i").pack


class RequestStatus(Enum):
    COMPILING = "compiling"  # its structured-output grammar is being compiled
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Request:
    """One request across its whole life, including preemptions.

    Token accounting, with steps possibly still in flight on the workers:

    - ``output_token_ids``: tokens whose step results have arrived.
    - ``num_pending_tokens``: tokens that in-flight steps will sample for this request; the
      worker already knows them (it feeds them forward on the GPU), the scheduler does not.
    - ``num_computed_tokens``: tokens whose KV is in the cache, or will be once the in-flight
      steps finish. It is advanced when a step is scheduled, not when its result arrives.

    Invariant while running: ``num_computed_tokens < num_known_tokens``, because every step
    that brings the computed tokens up to the known length also samples one more token.
    """

    request_id: str
    # A list, or (from the scheduler) an int32 array: no int object per prompt token.
    prompt_token_ids: Sequence[int]
    sampling: SamplingParams
    arrival_time: float
    # Order of receipt; breaks ties between equal arrival times (FCFS and preemption order).
    arrival_index: int
    seq_id: int = -1  # -1 while waiting; a fresh id for every admission
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_pending_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    first_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # Prompt tokens found in the prefix cache at the first admission (reported in usage).
    num_cached_tokens: int = 0
    # Prompt tokens whose KV this request computed, recomputation after preemption included.
    num_computed_prompt_tokens: int = 0
    # Prefix cache bookkeeping (see prefix_cache.py): the index entries of this request's
    # leading blocks, one per block, while it runs.
    prefix_nodes: list[PrefixNode] = field(default_factory=list)
    # Set when a block could not be indexed (its parent entry was evicted): index nothing
    # further.
    prefix_chain_broken: bool = False
    # Per-token stop screening (see stop.py ``stop_screen``): a new token needs the full
    # ``check_stop`` only if it is one of ``stop_screen_ids`` or the output has reached
    # ``stop_screen_length`` tokens. The defaults send every token to the full check.
    stop_screen_ids: frozenset[int] = frozenset()
    stop_screen_length: int = 0
    # The prompt packed as int32, as it arrived: a long prompt is sent to the workers and
    # looked up in the prefix cache without packing it again. Packed here when not given.
    prompt_packed: bytes = b""
    # Structured output: the request's place in its grammar (scheduler_proc/grammar.py's
    # RequestGrammar), once compiled; None for an unconstrained request.
    grammar: Any = None
    # The prompt never changes, so its length is kept rather than measured per step.
    num_prompt_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.prompt_token_ids)
        if len(self.prompt_packed) != 4 * self.num_prompt_tokens:
            self.prompt_packed = pack_ids(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus the generated tokens the scheduler has seen."""
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def num_known_tokens(self) -> int:
        """The sequence length the workers know: seen tokens plus those still in flight."""
        return self.num_tokens + self.num_pending_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return [*self.prompt_token_ids, *self.output_token_ids]

    def token_slice(self, start: int, end: int) -> list[int]:
        """Seen tokens ``start:end`` without concatenating the whole sequence."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return list(self.prompt_token_ids[start:end])
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return [*self.prompt_token_ids[start:], *self.output_token_ids[: end - num_prompt]]

    def packed_tokens(self, start: int, end: int) -> bytes:
        """``pack_ids(token_slice(start, end))``; the prompt's part is a slice of its bytes."""
        num_prompt = self.num_prompt_tokens
        if end <= num_prompt:
            return self.prompt_packed[4 * start : 4 * end]
        outputs = pack_ids(self.output_token_ids[max(start - num_prompt, 0) : end - num_prompt])
        if start >= num_prompt:
            return outputs
        return self.prompt_packed[4 * start :] + outputs

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def priority_key(self) -> tuple[int, float, int]:
        """Requests of lower priority value, then older ones, sort first: they are served
        first and preempted last (every priority is 0 unless the policy is "priority")."""
        return (self.sampling.priority, self.arrival_time, self.arrival_index)

    def summary(self) -> str:
        """The finished request's lifecycle log line (after its id). "computed N prompt
        tokens, M cached": N counts recomputation after preemption, M the prefix cache hit."""
        ttft = (
            f"{self.first_token_time - self.arrival_time:.3f}s"
            if self.first_token_time is not None
            else "-"
        )
        total = (self.finish_time or self.arrival_time) - self.arrival_time
        return (
            f"{self.num_prompt_tokens} prompt + {self.num_output_tokens} completion tokens, "
            f"computed {self.num_computed_prompt_tokens} prompt tokens, "
            f"{self.num_cached_tokens} cached, {self.finish_reason}, "
            f"preempted {self.num_preemptions}x, ttft {ttft}, total {total:.3f}s"
        )

    def to_output(self, new_token_ids: list[int]) -> SeqOutput:
        """This step's report to the detokenizer: the new tokens and, once over, how it ended."""
        if len(new_token_ids) == 1:
            return self.token_output(new_token_ids[0])
        # Positional: SeqOutput's first seven fields, in order (keywords cost twice as much).
        return SeqOutput(
            self.request_id,
            pack_ids(new_token_ids),
            self.finish_reason,
            self.stop_reason,
            self.num_prompt_tokens,
            len(self.output_token_ids),
            self.num_cached_tokens,
        )

    def token_output(self, token_id: int) -> SeqOutput:
        """``to_output([token_id])``, the report of every decode step: one token packed
        without building an array."""
        return SeqOutput(
            self.request_id,
            _pack_one_id(token_id),
            self.finish_reason,
            self.stop_reason,
            self.num_prompt_tokens,
            len(self.output_token_ids),
            self.num_cached_tokens,
        )
