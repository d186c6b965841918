"""xgrammar's view of the vocabulary, read from ``tokenizer.json``: the same as xgrammar
makes from the transformers tokenizer, for byte-level and byte-fallback vocabularies."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("xgrammar")


def byte_fallback_tokenizer_dir(path) -> str:
    """A small SentencePiece-style (Llama 2) tokenizer: '▁' for spaces, bytes as <0xNN>."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{byte:02X}>": 3 + byte for byte in range(256)})
    for piece in ["▁", "a", "b", "c", "t", "h", "e", "▁a", "▁ab", "▁t", "▁th", "▁the", "é"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "a"), ("▁a", "b"), ("▁", "t"), ("▁t", "h"), ("▁th", "e")]
    tokenizer = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>"})
    )
    return str(path)


@pytest.mark.parametrize("kind", ["qwen3", "byte_fallback"])
def test_the_vocabulary_reads_as_transformers_would_give_it(kind, tiny_qwen3_dir, tmp_path) -> None:
    import transformers
    import xgrammar

    from scheduler_proc.grammar import read_tokenizer_info

    folder = tiny_qwen3_dir if kind == "qwen3" else byte_fallback_tokenizer_dir(tmp_path)
    reference_tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    # Wider than the tokenizer, as a model's logits often are.
    vocab_size = len(reference_tokenizer) + 7
    stop_ids = [reference_tokenizer.eos_token_id]
    reference = xgrammar.TokenizerInfo.from_huggingface(
        reference_tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids
    )
    info = read_tokenizer_info(xgrammar, folder, vocab_size, stop_ids)
    assert info.vocab_type == reference.vocab_type
    assert info.vocab_type == (
        xgrammar.VocabType.BYTE_LEVEL if kind == "qwen3" else xgrammar.VocabType.BYTE_FALLBACK
    )
    assert info.add_prefix_space == reference.add_prefix_space
    assert info.vocab_size == reference.vocab_size == vocab_size
    assert info.decoded_vocab == reference.decoded_vocab
    assert info.stop_token_ids == reference.stop_token_ids == stop_ids
    assert info.special_token_ids == reference.special_token_ids
