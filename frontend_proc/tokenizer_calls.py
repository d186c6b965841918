"""/tokenize and /detokenize as calls to a tokenizer process.

The frontend holds no tokenizer (a large vocabulary costs every process that loads it tens of
MB): it sends a TokenizeRequest or DetokenizeRequest to the tokenizer processes, which answer
with ``answer`` below. ``InProcessTokenizer`` answers the same calls with a Preprocessor in
the caller's own process, for an app built without a process tree (tests).

This module must stay light to import: the frontend imports it, and only a tokenizer process
loads ``tokenizers`` and ``jinja2``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

from frontend_proc.errors import SERVER_ERROR, APIError, invalid
from frontend_proc.fields import check_token_ids
from pegainfer.protocol import (
    DetokenizeRequest,
    DetokenizeResult,
    ProtocolError,
    RequestRejected,
    TokenizeRequest,
    TokenizeResult,
    pack_ids,
    unpack_ids,
)

if TYPE_CHECKING:
    from frontend_proc.preprocess import Preprocessor

logger = logging.getLogger(__name__)

TokenizerCall = TokenizeRequest | DetokenizeRequest
TokenizerAnswer = TokenizeResult | DetokenizeResult | RequestRejected


class TokenizerService(Protocol):
    """What /tokenize and /detokenize need; a rejected call raises APIError."""

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResult: ...

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResult: ...


def tokenize(preprocessor: Preprocessor, request: TokenizeRequest) -> TokenizeResult:
    """Raises APIError for anything the client must fix."""
    if request.messages is not None:
        text = preprocessor.render_chat(
            request.messages,
            request.add_generation_prompt,
            request.chat_template_kwargs,
            request.tools,
            request.continue_final_message,
        )
    elif request.prompt is not None:
        text = request.prompt
    else:
        raise invalid("'prompt' (a string) or 'messages' is required", "prompt")
    tokenizer = preprocessor.tokenizer
    ids = tokenizer.encode(text, add_special_tokens=request.add_special_tokens).ids
    strs = [tokenizer.id_to_token(i) for i in ids] if request.return_token_strs else None
    return TokenizeResult(request_id=request.request_id, token_ids=pack_ids(ids), token_strs=strs)


def detokenize(preprocessor: Preprocessor, request: DetokenizeRequest) -> DetokenizeResult:
    """Raises APIError for an id outside the vocabulary."""
    try:
        ids = unpack_ids(request.token_ids)
    except ProtocolError as exc:
        raise invalid(f"malformed token ids: {exc}", "tokens") from None
    check_token_ids(ids, preprocessor.vocab_size, "tokens")
    text = preprocessor.tokenizer.decode(ids, skip_special_tokens=False)
    return DetokenizeResult(request_id=request.request_id, text=text)


def answer(preprocessor: Preprocessor, request: TokenizerCall) -> TokenizerAnswer:
    """One call to its answer; never raises, so one bad call cannot stop the process."""
    try:
        if isinstance(request, TokenizeRequest):
            return tokenize(preprocessor, request)
        return detokenize(preprocessor, request)
    except APIError as exc:
        return exc.to_rejection(request.request_id)
    except RecursionError:
        error = invalid("the chat template recursed too deeply on this conversation")
        return error.to_rejection(request.request_id)
    except Exception as exc:  # noqa: BLE001 - a bug here must cost one call, not the process
        logger.exception("%s %s failed", type(request).__name__, request.request_id)
        error = APIError(
            500, f"internal error in the tokenizer: {type(exc).__name__}", SERVER_ERROR
        )
        return error.to_rejection(request.request_id)


def raise_if_rejected(outcome: TokenizerAnswer) -> TokenizeResult | DetokenizeResult:
    if isinstance(outcome, RequestRejected):
        raise APIError.from_rejection(outcome)
    return outcome


class InProcessTokenizer:
    """A TokenizerService over a Preprocessor in this process."""

    def __init__(self, preprocessor: Preprocessor) -> None:
        self.preprocessor = preprocessor

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResult:
        result = raise_if_rejected(answer(self.preprocessor, request))
        assert isinstance(result, TokenizeResult)
        return result

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResult:
        result = raise_if_rejected(answer(self.preprocessor, request))
        assert isinstance(result, DetokenizeResult)
        return result
