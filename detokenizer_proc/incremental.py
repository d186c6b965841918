"""Incremental detokenization: turn a growing list of token ids into text deltas.

Decoding each token alone is wrong for byte-level BPE: one character (an emoji, a CJK
character) can span several tokens, and a token can start inside a character. So each
request keeps all its ids and two offsets into them:

- ``prefix_offset``: where the context window starts; text before it has been emitted.
- ``read_offset``: where the ids not yet turned into emitted text start.

Each update decodes ``ids[prefix_offset:read_offset]`` and ``ids[prefix_offset:]`` and
emits what the second adds to the first. When the newest text ends with U+FFFD, the last
character is still incomplete: it is held back until more tokens complete it, or until the
request finishes, when whatever the decoder gives is flushed.

The window starts where earlier emitted text ended on a complete character, and UTF-8
never extends a complete character, so the deltas join up to exactly the full decode.
"""

from __future__ import annotations

from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"


class TextDecoder(Protocol):
    """A tokenizer, or anything that decodes ids as one does."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """The text state of one request."""

    __slots__ = ("tokenizer", "skip_special_tokens", "token_ids", "prefix_offset", "read_offset")

    def __init__(self, tokenizer: TextDecoder, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, new_token_ids: list[int], finished: bool = False) -> str:
        """Add tokens; return the new complete text (everything that is left, if finished)."""
        self.token_ids.extend(new_token_ids)
        if self.read_offset == len(self.token_ids):
            return ""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        if not finished and (
            len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR)
        ):
            return ""
        delta = full_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return delta

    def flush(self) -> str:
        """The text still held back, as the request finishes."""
        return self.update([], finished=True)
