"""The exact bytes of single tokens, for logprobs.

Decoding one token of a byte-level BPE alone loses bytes: a token that holds half of a
multi-byte character decodes to U+FFFD. OpenAI's logprobs give each token's own bytes, so
they are read from the vocabulary instead: byte-level BPE spells every byte as one printable
character (GPT-2's table), and SentencePiece-style vocabularies spell a space as U+2581 and a
raw byte as ``<0xNN>``. Added tokens (specials, ``<think>``) are their own text.
"""

from __future__ import annotations

import re

from tokenizers import Tokenizer

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
SPIECE_SPACE = "\u2581"


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's map from printable stand-in characters back to bytes."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    codes = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {chr(code): byte for byte, code in zip(printable, codes)}


BYTE_LEVEL = _byte_level_alphabet()


class TokenBytes:
    """Token id -> its bytes, computed on first use and cached."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._byte_level = type(tokenizer.decoder).__name__ == "ByteLevel"
        self._added = {
            token_id: added.content
            for token_id, added in tokenizer.get_added_tokens_decoder().items()
        }
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._compute(token_id)
            self._cache[token_id] = cached
        return cached

    def many(self, token_ids: list[int]) -> list[bytes]:
        return [self(token_id) for token_id in token_ids]

    def _compute(self, token_id: int) -> bytes:
        added = self._added.get(token_id)
        if added is not None:
            return added.encode("utf-8")
        piece = self.tokenizer.id_to_token(token_id) if token_id >= 0 else None
        if piece is None:
            return b""
        if self._byte_level and all(char in BYTE_LEVEL for char in piece):
            return bytes(BYTE_LEVEL[char] for char in piece)
        match = _BYTE_TOKEN.fullmatch(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        if SPIECE_SPACE in piece:
            return piece.replace(SPIECE_SPACE, " ").encode("utf-8")
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")
