"""Random-weight checkpoints written by tools/make_tiny_checkpoint.py."""

from __future__ import annotations

import json
import os

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from tools.checkpoint_presets import QWEN3_VOCAB  # noqa: E402
from tools.make_tiny_checkpoint import (  # noqa: E402
    build_config,
    make_checkpoint,
    random_tensor,
    write_direct_checkpoint,
)

THINK = "<think>"
THINK_END = "</think>"


def _load(path: str):
    return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


@pytest.fixture(scope="module")
def tiny_qwen3(tiny_qwen3_dir):
    return _load(tiny_qwen3_dir)


def _index(path: str) -> dict[str, str]:
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        return json.load(f)["weight_map"]


def test_tiny_qwen3_is_sharded_with_an_index(tiny_qwen3_dir, tiny_qwen3):
    weight_map = _index(tiny_qwen3_dir)
    shards = sorted(set(weight_map.values()))
    assert len(shards) >= 2
    assert all(os.path.isfile(os.path.join(tiny_qwen3_dir, s)) for s in shards)
    # Tied: the index names the embedding only, and transformers ties lm_head to it.
    assert "lm_head.weight" not in weight_map
    assert set(weight_map) == set(tiny_qwen3.state_dict()) - {"lm_head.weight"}
    assert tiny_qwen3.lm_head.weight.data_ptr() == tiny_qwen3.model.embed_tokens.weight.data_ptr()


def test_tiny_qwen3_config(tiny_qwen3_dir, tiny_qwen3):
    config = tiny_qwen3.config
    assert config.architectures == ["Qwen3ForCausalLM"]
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (64, 128, 2)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 32)
    assert config.vocab_size == QWEN3_VOCAB and config.tie_word_embeddings
    assert config.rope_parameters["rope_theta"] == 1e6 and config.rms_norm_eps == 1e-6
    with open(os.path.join(tiny_qwen3_dir, "config.json")) as f:
        raw = json.load(f)
    # The spellings of Hub checkpoints, beside transformers 5's own.
    assert raw["rope_theta"] == 1e6 and raw["torch_dtype"] == "float32"


def test_weights_are_deterministic(tiny_qwen3):
    for name, value in tiny_qwen3.state_dict().items():
        if name != "lm_head.weight":
            assert torch.equal(value, random_tensor(name, tuple(value.shape), 0, value.dtype))
    a = random_tensor("model.layers.0.mlp.up_proj.weight", (8, 8), 0, torch.float32)
    b = random_tensor("model.layers.0.mlp.up_proj.weight", (8, 8), 1, torch.float32)
    assert not torch.equal(a, b)


def test_random_model_is_not_degenerate(tiny_qwen3):
    prompt = torch.arange(1000, 1032).unsqueeze(0)
    with torch.no_grad():
        logits = tiny_qwen3(prompt).logits[0]
        out = tiny_qwen3.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0)
    argmax = logits.argmax(-1)
    assert argmax.unique().numel() >= 24  # predictions vary across positions
    assert not torch.equal(argmax, prompt[0])  # and do not just echo the input
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).median() > 0.05  # greedy survives rounding noise
    assert out[0, 32:].unique().numel() >= 12  # greedy decoding does not lock into a loop


def test_tokenizer_and_chat_template(tiny_qwen3_dir):
    tok = transformers.AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    assert len(tok) <= QWEN3_VOCAB
    assert tok.convert_tokens_to_ids([THINK, THINK_END, "<|im_end|>"]) == [151667, 151668, 151645]
    messages = [{"role": "user", "content": "Hi"}]
    thinking = tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=True
    )
    assert thinking.endswith("<|im_start|>assistant\n")
    plain = tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert plain == thinking + f"{THINK}\n\n{THINK_END}\n\n"
    ids = tok(plain)["input_ids"]
    assert 151667 in ids and 151668 in ids


def test_direct_writer_matches_transformers_writer(tiny_qwen3_dir, tiny_qwen3, tmp_path):
    # The real-shape presets are written without transformers; check that path on tiny shapes.
    out = str(tmp_path)
    config = build_config("qwen3", "tiny", "float32")
    write_direct_checkpoint(out, config, seed=0, dtype="float32", shard_bytes=8 * 2**20)
    assert len(set(_index(out).values())) >= 2
    model = _load(out)
    ours, theirs = model.state_dict(), tiny_qwen3.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    for name in ("config.json", "generation_config.json"):
        with open(os.path.join(out, name)) as a, open(os.path.join(tiny_qwen3_dir, name)) as b:
            assert json.load(a) == json.load(b)


def test_tiny_qwen3_moe_is_written_as_the_hub_writes_it(tiny_qwen3_moe_dir, tmp_path):
    names = _index(tiny_qwen3_moe_dir)
    # Layers 0 and 2 sparse (eight experts, three projections each), layer 1 dense.
    assert sum(".mlp.experts." in n for n in names) == 2 * 8 * 3
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in names
    assert "model.layers.1.mlp.gate_proj.weight" in names
    with open(os.path.join(tiny_qwen3_moe_dir, "config.json")) as f:
        config = json.load(f)
    assert config["num_experts"] == 8 and config["architectures"] == ["Qwen3MoeForCausalLM"]
    model = _load(tiny_qwen3_moe_dir)
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert logits.std() > 0.5

    # The writer without transformers stores the same names and values.
    out = str(tmp_path)
    write_direct_checkpoint(
        out, build_config("qwen3_moe", "tiny", "float32"), seed=0, dtype="float32"
    )
    direct = _index(out)
    assert direct.keys() == names.keys()
    ours, theirs = _load(out).state_dict(), model.state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_layer_count_override(tmp_path):
    config = build_config("qwen3_moe", "30b-a3b", "bfloat16", num_layers=2)
    assert config.num_hidden_layers == 2 and config.num_experts_per_tok == 8


def test_tiny_llama_untied_bfloat16(tmp_path):
    out = make_checkpoint(str(tmp_path), arch="llama", preset="tiny", seed=3, dtype="bfloat16")
    model = _load(out)
    assert model.config.architectures == ["LlamaForCausalLM"]
    assert model.dtype == torch.bfloat16 and not model.config.tie_word_embeddings
    assert "lm_head.weight" in _index(out)
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = tok("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out_ids = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert out_ids.shape[1] == ids.shape[1] + 8


def test_unknown_preset_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no preset"):
        make_checkpoint(str(tmp_path), arch="llama", preset="8b")
    with pytest.raises(ValueError, match="unknown arch"):
        make_checkpoint(str(tmp_path), arch="gpt2")
