"""What the detokenizer decodes with: the compact byte table where the tokenizer is byte-level
BPE (see byte_level_vocab), the tokenizer itself otherwise. Both give the same text for the
same ids, and the same bytes per token for logprobs."""

from __future__ import annotations

from typing import Any, Protocol

from detokenizer_proc.byte_level_vocab import ByteLevelVocab
from detokenizer_proc.token_bytes import TokenBytes


class TokenDecoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def token_bytes(self, ids: list[int]) -> list[bytes]: ...


class TokenizerDecoder:
    """Decoding through a ``tokenizers.Tokenizer``, for vocabularies the byte table does not
    cover."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._bytes = TokenBytes(tokenizer)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, ids: list[int]) -> list[bytes]:
        return self._bytes.many(ids)


def decoder_for(tokenizer: Any) -> TokenDecoder:
    """The lightest decoder that decodes exactly as ``tokenizer`` does; a decoder is kept."""
    if isinstance(tokenizer, (ByteLevelVocab, TokenizerDecoder)):
        return tokenizer
    vocab = ByteLevelVocab.from_tokenizer(tokenizer)
    return vocab if vocab is not None else TokenizerDecoder(tokenizer)
