"""Logprobs in OpenAI's two shapes.

The engine sends, per delta, a ``TokenLogprobs`` record with each token's exact bytes (filled
by the detokenizer). A token's text is its bytes as UTF-8, or escaped (``\\xe4``) when they
are only part of a character, as OpenAI shows them. Completions use the legacy shape
(``tokens``, ``token_logprobs``, ``top_logprobs`` as maps, ``text_offset``); chat uses
``content: [{token, logprob, bytes, top_logprobs: [...]}]``. vLLM's ``prompt_logprobs`` field
is a list by prompt position (None for the first token), each a map from token id to
``{logprob, rank, decoded_token}``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pegainfer.protocol import ProtocolError, TokenLogprobs, unpack_floats, unpack_ids

# JSON has no -Infinity; a token the model rules out entirely gets this, as vLLM does.
MIN_LOGPROB = -9999.0


def token_text(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("utf-8", errors="backslashreplace")


def _finite(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


@dataclass
class TokenEntry:
    """One token's logprob and its alternatives (``logprob`` None: the first prompt token)."""

    token_id: int
    data: bytes
    logprob: float | None
    top: list[tuple[int, bytes, float]] = field(default_factory=list)
    rank: int | None = None  # in the vocabulary, 1 the likeliest; None if not sent

    @property
    def text(self) -> str:
        return token_text(self.data)


def entries(record: TokenLogprobs | None) -> list[TokenEntry]:
    """Unpack one record; a malformed one yields nothing rather than an error."""
    if record is None:
        return []
    try:
        ids = unpack_ids(record.token_ids)
        values = unpack_floats(record.logprobs)
        top_ids = unpack_ids(record.top_ids)
        top_values = unpack_floats(record.top_logprobs)
        ranks = unpack_ids(record.ranks)
    except ProtocolError:
        return []
    n, k = len(ids), max(record.num_top, 0)
    data = record.token_bytes
    if len(values) != n or len(top_ids) != n * k or len(top_values) != n * k:
        return []
    if len(data) != n + n * k:
        data = [b""] * (n + n * k)
    if len(ranks) != n:
        ranks = [None] * n
    result = []
    for i in range(n):
        value = values[i]
        if math.isnan(value):  # the first prompt token: nothing predicts it
            result.append(TokenEntry(ids[i], data[i], None))
            continue
        top = [
            (top_ids[i * k + j], data[n + i * k + j], _finite(top_values[i * k + j]))
            for j in range(k)
            if top_ids[i * k + j] >= 0
        ]
        result.append(TokenEntry(ids[i], data[i], _finite(value), top, ranks[i]))
    return result


class PromptLogprobs:
    """Prompt logprob entries by position; a span computed twice (after a preemption)
    simply overwrites itself."""

    def __init__(self) -> None:
        self._by_position: dict[int, TokenEntry] = {}

    def add(self, record: TokenLogprobs | None) -> None:
        if record is None:
            return
        for offset, entry in enumerate(entries(record)):
            self._by_position[record.start + offset] = entry

    def ordered(self) -> list[TokenEntry]:
        return [self._by_position[p] for p in sorted(self._by_position)]


def token_label(token_id: int, data: bytes, as_token_ids: bool) -> str:
    """A token as logprobs name it: its text, or ``token_id:<id>`` (vLLM's
    ``return_tokens_as_token_ids``, for tokens whose text does not say which they are)."""
    return f"token_id:{token_id}" if as_token_ids else token_text(data)


def completion_logprobs(
    tokens: list[TokenEntry], num_top: int, text_offset_start: int = 0, as_token_ids: bool = False
) -> dict[str, Any]:
    """The legacy completions shape; ``top_logprobs`` maps have the ``num_top`` best tokens
    plus the chosen one when it is not among them. Offsets count the tokens' text."""
    texts, logprobs, tops, offsets = [], [], [], []
    offset = text_offset_start
    for entry in tokens:
        text = token_label(entry.token_id, entry.data, as_token_ids)
        texts.append(text)
        logprobs.append(entry.logprob)
        offsets.append(offset)
        offset += len(entry.text)
        if entry.logprob is None:
            tops.append(None)
            continue
        top: dict[str, float] = {}
        for token_id, data, value in entry.top[:num_top]:
            top.setdefault(token_label(token_id, data, as_token_ids), value)
        top.setdefault(text, entry.logprob)
        tops.append(top)
    return {
        "tokens": texts,
        "token_logprobs": logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(
    tokens: list[TokenEntry], num_top: int, as_token_ids: bool = False
) -> dict[str, Any]:
    content = []
    for entry in tokens:
        if entry.logprob is None:
            continue
        content.append(
            {
                "token": token_label(entry.token_id, entry.data, as_token_ids),
                "logprob": entry.logprob,
                "bytes": list(entry.data),
                "top_logprobs": [
                    {
                        "token": token_label(token_id, data, as_token_ids),
                        "logprob": value,
                        "bytes": list(data),
                    }
                    for token_id, data, value in entry.top[:num_top]
                ],
            }
        )
    return {"content": content}


def prompt_logprobs_field(tokens: list[TokenEntry], num_top: int) -> list[Any]:
    """vLLM's ``prompt_logprobs``: for each prompt token, a map from token id to its logprob,
    rank and text, the prompt's own token first and then the ``num_top`` likeliest; the
    first prompt token, which nothing predicts, is None."""
    result: list[Any] = []
    for entry in tokens:
        if entry.logprob is None:
            result.append(None)
            continue
        by_id = {
            str(entry.token_id): {
                "logprob": entry.logprob,
                "rank": entry.rank,
                "decoded_token": entry.text,
            }
        }
        for rank, (token_id, data, value) in enumerate(entry.top[:num_top], start=1):
            by_id.setdefault(
                str(token_id),
                {"logprob": value, "rank": rank, "decoded_token": token_text(data)},
            )
        result.append(by_id)
    return result
