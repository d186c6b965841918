"""What a tokenizer process does to one request, without sockets: render the chat template,
tokenize, check the prompt against the vocabulary and the context window, and resolve
``max_tokens``. Every user-caused problem is a 400 ``APIError``."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from frontend_proc.chat_template import ChatTemplate
from frontend_proc.engine_extras import bad_words_token_ids, truncate_prompt
from frontend_proc.errors import SERVER_ERROR, APIError, invalid
from frontend_proc.fields import check_sampling_token_ids, check_token_ids
from frontend_proc.limits import resolve_max_tokens
from frontend_proc.reasoning import THINK_END, THINK_START, turn_reasoning
from frontend_proc.tool_calls import TEMPLATE_MARK
from pegainfer.protocol import (
    GenerateRequest,
    ProtocolError,
    RequestRejected,
    SamplingParams,
    TokenizedRequest,
    pack_ids,
    unpack_ids,
    unpack_ids_array,
)

logger = logging.getLogger(__name__)


class Preprocessor:
    """Turns GenerateRequests into TokenizedRequests for one model."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: ChatTemplate | None,
        max_model_len: int,
        vocab_size: int,
        reasoning_parser: str = "auto",
    ) -> None:
        """``reasoning_parser``: "auto" splits ``<think>`` blocks off where the model writes
        them (``reasons_in_think_blocks``), "none" never, any other name always."""
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        # (<think>'s id, </think>'s id, the ids of the special tokens) for a reasoning model.
        self._think: tuple[int, int, frozenset[int]] | None = None
        if reasoning_parser == "auto":
            reasons = self.reasons_in_think_blocks()
        else:
            reasons = reasoning_parser != "none" and has_think_tokens(tokenizer)
        if reasons:
            added = self.tokenizer.get_added_tokens_decoder()
            self._think = (
                self.tokenizer.token_to_id(THINK_START),
                self.tokenizer.token_to_id(THINK_END),
                frozenset(token_id for token_id, token in added.items() if token.special),
            )

    @property
    def reasoning(self) -> bool:
        """Chat outputs are split into reasoning and answer at ``</think>``."""
        return self._think is not None

    def reasons_in_think_blocks(self) -> bool:
        """Whether the model writes its reasoning between <think> and </think> (Qwen3):
        the tags are tokens of their own and its chat template knows them."""
        source = self.chat_template.source if self.chat_template is not None else ""
        return has_think_tokens(self.tokenizer) and THINK_END in source

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        chat_template_kwargs: dict[str, Any],
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        if self.chat_template is None:
            raise invalid(
                "this model has no chat template; use /v1/completions instead", "messages"
            )
        if tools and TEMPLATE_MARK not in self.chat_template.source:
            raise invalid(
                "this model's chat template has no tool-call format this server can parse "
                "(<tool_call> blocks); send 'tool_choice': \"none\" or no tools",
                "tools",
            )
        return self.chat_template.render(
            messages, add_generation_prompt, chat_template_kwargs, tools, continue_final_message
        )

    def prompt_ids(self, request: GenerateRequest) -> bytes:
        """The prompt's token ids, packed (``pack_ids``)."""
        if request.messages is not None:
            text = self.render_chat(
                request.messages,
                request.add_generation_prompt,
                request.chat_template_kwargs,
                request.tools,
                request.continue_final_message,
            )
            # The template already wrote every special token the model expects.
            add_special = bool(request.add_special_tokens)
            ids = self.tokenizer.encode(text, add_special_tokens=add_special).ids
            return self.in_vocabulary(pack_ids(ids), "messages")
        if request.prompt_token_ids is not None:
            return self.checked_packed_ids(request.prompt_token_ids)
        if request.prompt is not None:
            # As HF's tokenizer(prompt) does: the post-processor adds BOS where the model wants it.
            add_special = request.add_special_tokens is not False
            ids = self.tokenizer.encode(request.prompt, add_special_tokens=add_special).ids
            return self.in_vocabulary(pack_ids(ids), "prompt")
        raise invalid("the request has neither a prompt nor messages", "prompt")

    def in_vocabulary(self, packed: bytes, param: str) -> bytes:
        """Tokenized text, checked against the model's vocabulary: a tokenizer with more
        tokens than the model's embedding (a checkpoint whose two disagree) must cost the
        request, not the worker."""
        if packed and int(np.frombuffer(packed, dtype="<i4").max()) >= self.vocab_size:
            largest = int(np.frombuffer(packed, dtype="<i4").max())
            raise invalid(
                f"the {param} tokenize to token id {largest}, outside the model's "
                f"vocabulary of {self.vocab_size}: its tokenizer and its weights disagree",
                param,
            )
        return packed

    def checked_packed_ids(self, packed: bytes) -> bytes:
        """Client-given ids, passed on as they came once each is known to name a token."""
        try:
            ids = unpack_ids(packed)
        except ProtocolError as exc:
            raise invalid(f"malformed prompt token ids: {exc}", "prompt") from None
        check_token_ids(ids, self.vocab_size, "prompt")
        return bytes(packed)

    def process(self, request: GenerateRequest) -> TokenizedRequest:
        """Raises APIError for anything the client must fix."""
        check_sampling_token_ids(request.sampling, self.vocab_size)
        packed = truncate_prompt(
            self.prompt_ids(request), request.truncate_prompt_tokens, self.max_model_len
        )
        sampling = resolve_max_tokens(
            len(packed) // 4, request.sampling, self.max_model_len, request.messages is not None
        )
        if sampling.bad_words:
            sequences = self.bad_words_token_ids(sampling.bad_words)
            sampling = dataclasses.replace(sampling, bad_words_token_ids=sequences)
        if request.messages is not None and self._think is not None:
            sampling = self.with_reasoning(sampling, packed)
        return TokenizedRequest(
            request_id=request.request_id,
            prompt_token_ids=packed,
            sampling=sampling,
            arrival_time=request.arrival_time,
        )

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        def encode(text: str) -> list[int]:
            return self.tokenizer.encode(text, add_special_tokens=False).ids

        sequences = bad_words_token_ids(words, encode)
        for ids in sequences:
            check_token_ids(ids, self.vocab_size, "bad_words")
        return sequences

    def with_reasoning(self, sampling: SamplingParams, packed: bytes) -> SamplingParams:
        """A reasoning model's chat sampling: whether the output starts inside a think block
        the prompt opened, and a constraint that holds after the reasoning (from the token
        after ``</think>``) unless the prompt closed it."""
        assert self._think is not None
        think_start_id, think_end_id, turn_marks = self._think
        state = turn_reasoning(unpack_ids_array(packed), think_start_id, think_end_id, turn_marks)
        changes: dict[str, Any] = {}
        if state == "open":
            changes["starts_in_reasoning"] = True
        if sampling.structured is not None and state != "closed":
            changes["structured"] = dataclasses.replace(
                sampling.structured, after_token_id=think_end_id
            )
        return dataclasses.replace(sampling, **changes) if changes else sampling


def has_think_tokens(tokenizer: Tokenizer) -> bool:
    added = {token.content for token in tokenizer.get_added_tokens_decoder().values()}
    return THINK_START in added and THINK_END in added


def handle(
    preprocessor: Preprocessor, request: GenerateRequest
) -> TokenizedRequest | RequestRejected:
    """One request to its outcome; never raises, so one bad request cannot stop the process."""
    try:
        return preprocessor.process(request)
    except APIError as exc:
        return exc.to_rejection(request.request_id)
    except RecursionError:
        return invalid("the chat template recursed too deeply on this conversation").to_rejection(
            request.request_id
        )
    except Exception as exc:  # noqa: BLE001 - a bug here must cost one request, not the process
        logger.exception("request %s failed", request.request_id)
        error = APIError(
            500, f"internal error while tokenizing: {type(exc).__name__}", SERVER_ERROR
        )
        return error.to_rejection(request.request_id)
