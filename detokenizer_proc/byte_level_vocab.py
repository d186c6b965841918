"""A byte-level BPE vocabulary as one bytes blob, to decode without the tokenizer object.

The detokenizer only turns ids into text. With a byte-level BPE (GPT-2's scheme, used by
Qwen, Llama 3 and SmolLM2) the text of a run of ids is their bytes joined and decoded as
UTF-8, invalid sequences replaced by U+FFFD, with special tokens left out on request. The bytes of
every token in one blob plus an offsets array take about 2 MB for a 151k vocabulary; the
tokenizer object holds tens of MB (the vocabulary both ways, the merges, the pre-tokenizer),
which an idle detokenizer would keep resident for nothing.

``from_tokenizer`` builds the table and checks it against the tokenizer's own decode on a
sample; on any difference (a decoder that does more than byte-level) it returns None and the
detokenizer keeps the tokenizer.
"""

from __future__ import annotations

import logging
import random
import re
from array import array
from bisect import bisect_right
from itertools import accumulate
from typing import Any

from detokenizer_proc.token_bytes import BYTE_LEVEL, SPIECE_SPACE

logger = logging.getLogger(__name__)

# Characters of GPT-2's byte alphabet, to the byte each one stands for (as a latin-1 char).
_TO_LATIN1 = {ord(char): chr(byte) for char, byte in BYTE_LEVEL.items()}
# A piece with any other character is not byte-level spelled: its bytes are its UTF-8.
_NOT_BYTE_LEVEL = re.compile("[^" + "".join(re.escape(char) for char in BYTE_LEVEL) + "]")
_SAMPLE_SEED = 0
_SAMPLE_IDS = 1024


class ByteLevelVocab:
    """Token id -> bytes for decoding, and the exact bytes each token shows in logprobs."""

    __slots__ = ("size", "_blob", "_offsets", "_special", "_logprob_bytes")

    def __init__(
        self,
        blob: bytes,
        lengths: list[int],
        special_ids: set[int],
        logprob_bytes: dict[int, bytes] | None = None,
    ) -> None:
        """``blob`` holds the bytes of every token in id order, ``lengths[i]`` of token i."""
        self.size = len(lengths)
        self._blob = blob
        self._offsets = array("Q", [0])
        self._offsets.extend(accumulate(lengths))
        if self._offsets[-1] != len(blob):
            raise ValueError("the token lengths do not add up to the blob")
        self._special = frozenset(special_ids)
        # The few tokens whose logprob bytes differ from what decoding gives (added tokens
        # are shown as their text).
        self._logprob_bytes = dict(logprob_bytes or {})

    def _bytes(self, token_id: int) -> bytes:
        if 0 <= token_id < self.size:
            return self._blob[self._offsets[token_id] : self._offsets[token_id + 1]]
        return b""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """As the tokenizer decodes: unknown ids add nothing."""
        blob, offsets, size = self._blob, self._offsets, self.size
        # Inlined slices: this runs twice per request and step.
        if skip_special_tokens and self._special:
            special = self._special
            parts = [
                blob[offsets[i] : offsets[i + 1]] for i in ids if 0 <= i < size and i not in special
            ]
        else:
            parts = [blob[offsets[i] : offsets[i + 1]] for i in ids if 0 <= i < size]
        return b"".join(parts).decode("utf-8", errors="replace")

    def token_bytes(self, ids: list[int]) -> list[bytes]:
        """The bytes of each token alone, for logprobs (see token_bytes.TokenBytes)."""
        overrides = self._logprob_bytes
        return [overrides[i] if i in overrides else self._bytes(i) for i in ids]

    @property
    def nbytes(self) -> int:
        return len(self._blob) + self._offsets.itemsize * len(self._offsets)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> ByteLevelVocab | None:
        """The table of a byte-level tokenizer, or None if it is not one or the table would
        decode anything differently from it."""
        if type(tokenizer.decoder).__name__ != "ByteLevel":
            return None
        # As the tokenizer's id_to_token: an added token's text first, then the model's piece.
        added_tokens = tokenizer.get_added_tokens_decoder()
        added = {token_id: token.content for token_id, token in added_tokens.items()}
        special = {token_id for token_id, token in added_tokens.items() if token.special}
        model_vocab = tokenizer.get_vocab(with_added_tokens=False)
        by_id = {token_id: piece for piece, token_id in model_vocab.items()}
        del model_vocab
        by_id.update(added)
        size = max(by_id, default=-1) + 1
        texts = [by_id.get(token_id, "") for token_id in range(size)]
        del by_id
        blob, lengths, logprob_bytes = _encode_pieces(texts, added)
        vocab = cls(blob, lengths, special, logprob_bytes)
        mismatch = vocab.first_mismatch(tokenizer, sorted(added))
        if mismatch is not None:
            logger.warning("decoding with the tokenizer: the byte table differs on %s", mismatch)
            return None
        return vocab

    def first_mismatch(self, tokenizer: Any, added_ids: list[int]) -> list[int] | None:
        """A sample of ids (every added token, random runs of the rest) on which this table
        and the tokenizer decode differently, or None if they agree."""
        rng = random.Random(_SAMPLE_SEED)
        singles = added_ids + rng.sample(range(self.size), min(_SAMPLE_IDS, self.size))
        runs = [singles] + [[rng.randrange(self.size) for _ in range(64)] for _ in range(32)]
        for ids in [[i] for i in singles] + runs:
            for skip in (True, False):
                if self.decode(ids, skip) != tokenizer.decode(ids, skip_special_tokens=skip):
                    return ids
        return None


def _encode_pieces(
    texts: list[str], added: dict[int, str]
) -> tuple[bytes, list[int], dict[int, bytes]]:
    """The blob and per-token byte lengths of all pieces, and the logprob bytes that differ.

    A piece spelled in the byte alphabet is one byte per character, so the whole vocabulary
    converts with one ``translate``; the rare pieces outside the alphabet (their bytes are
    their UTF-8) are found with one regex scan and spliced in."""
    lengths = list(map(len, texts))
    starts = list(accumulate(lengths, initial=0))
    joined = "".join(texts)
    odd = sorted({bisect_right(starts, m.start()) - 1 for m in _NOT_BYTE_LEVEL.finditer(joined)})
    parts: list[bytes] = []
    logprob_bytes: dict[int, bytes] = {}
    done = 0  # pieces before this index are in parts
    for token_id in odd:
        parts.append(
            joined[starts[done] : starts[token_id]].translate(_TO_LATIN1).encode("latin-1")
        )
        text = texts[token_id]
        parts.append(text.encode("utf-8"))
        lengths[token_id] = len(parts[-1])
        if SPIECE_SPACE in text and token_id not in added:
            logprob_bytes[token_id] = text.replace(SPIECE_SPACE, " ").encode("utf-8")
        done = token_id + 1
    parts.append(joined[starts[done] :].translate(_TO_LATIN1).encode("latin-1"))
    blob = b"".join(parts)
    offsets = list(accumulate(lengths, initial=0))
    for token_id, text in added.items():  # shown as their text
        shown = text.encode("utf-8")
        if shown != blob[offsets[token_id] : offsets[token_id + 1]]:
            logprob_bytes[token_id] = shown
    return blob, lengths, logprob_bytes
