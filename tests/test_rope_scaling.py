"""Rope scaling: the frequencies of each type against HF transformers, the config overrides
that set it (``--hf-overrides``, ``--rope-scaling``), and the context length it allows."""

from __future__ import annotations

import json
import random

import pytest
import torch

from pegainfer.cli import build_parser, config_from_args
from pegainfer.config import ALLOW_LONG_ENV, EngineConfig, finalize, read_model_info
from pegainfer.hf_config import (
    apply_overrides,
    check_rope_scaling,
    max_context_len,
    parse_hf_overrides,
    rope_settings,
)
from worker_proc.layers.rope_scaling import rope_frequencies
from worker_proc.layers.rotary import RotaryEmbedding
from worker_proc.model_config import load_model_config

transformers = pytest.importorskip("transformers")

QWEN3_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}


def _random_scalings(rng: random.Random) -> list[dict]:
    """Each type with fresh parameters; YaRN with and without its optional fields."""
    original = rng.choice([2048, 4096, 8192, 32768])
    return [
        {"rope_type": "default"},
        {"rope_type": "linear", "factor": rng.uniform(1.5, 8.0)},
        {
            "rope_type": "llama3",
            "factor": rng.choice([8.0, 32.0]),
            "low_freq_factor": 1.0,
            "high_freq_factor": rng.choice([2.0, 4.0]),
            "original_max_position_embeddings": original,
        },
        {"rope_type": "yarn", "factor": rng.uniform(1.5, 40.0), "original_max_position_embeddings": original},
        {
            "rope_type": "yarn",
            "factor": rng.uniform(1.5, 40.0),
            "original_max_position_embeddings": original,
            "beta_fast": rng.choice([16, 32, 64]),
            "beta_slow": rng.choice([1, 2]),
            "mscale": rng.uniform(0.5, 1.0),
            "mscale_all_dim": rng.uniform(0.5, 1.0),
            "truncate": rng.random() < 0.5,
        },
        {**QWEN3_YARN, "attention_factor": rng.uniform(0.8, 1.5)},
    ]  # fmt: skip


@pytest.mark.parametrize("head_dim", [64, 128])
def test_frequencies_and_attention_factor_match_transformers(head_dim):
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rng = random.Random()
    base = rng.choice([10_000.0, 500_000.0, 1_000_000.0])
    for scaling in _random_scalings(rng):
        config = Qwen3Config(
            head_dim=head_dim,
            max_position_embeddings=scaling.get("original_max_position_embeddings", 4096) * 2,
            rope_parameters={**scaling, "rope_theta": base},
        )
        kind = scaling["rope_type"]
        if kind == "default":
            exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
            expected, expected_factor = 1.0 / base**exponents, 1.0
        else:
            expected, expected_factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
        _, ours_scaling = rope_settings({"rope_parameters": {**scaling, "rope_theta": base}})
        inv_freq, factor = rope_frequencies(base, head_dim, ours_scaling)
        assert not torch.isnan(inv_freq).any()
        torch.testing.assert_close(inv_freq, expected.float(), rtol=1e-6, atol=0)
        assert factor == pytest.approx(expected_factor, rel=1e-12), scaling


def test_the_cos_sin_cache_carries_yarn_attention_factor():
    rotary = RotaryEmbedding(128, 64, 1_000_000.0, QWEN3_YARN)
    _, factor = rope_frequencies(1_000_000.0, 128, QWEN3_YARN)
    assert factor == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)
    # Position 0: every angle is 0, so cos is the factor itself and sin nothing.
    torch.testing.assert_close(rotary.cos_cache[0], torch.full((64,), factor))
    assert rotary.sin_cache[0].abs().max() == 0
    radius = (rotary.cos_cache**2 + rotary.sin_cache**2).sqrt()
    torch.testing.assert_close(radius, torch.full_like(radius, factor))


def test_an_override_replaces_the_scaling_in_either_form_of_the_config():
    old_form = {"rope_theta": 1e6, "rope_scaling": None, "max_position_embeddings": 40960}
    new_form = {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, **old_form}
    for hf in (old_form, new_form):
        merged = apply_overrides(hf, {"rope_scaling": QWEN3_YARN})
        theta, scaling = rope_settings(merged)
        assert theta == 1e6 and scaling == QWEN3_YARN
        assert max_context_len(merged) == 131_072
        assert rope_settings(hf) == (1e6, None)  # the file's dict is left as it was
    assert max_context_len(old_form) == 40960


def test_the_longest_context_follows_the_scaling():
    def longest(scaling: dict) -> int:
        return max_context_len({"max_position_embeddings": 8192, "rope_scaling": scaling})

    assert longest({"rope_type": "linear", "factor": 2.0}) == 16384
    # llama3's config already names the extended context.
    assert (
        longest({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 1024})
        == 8192
    )
    assert (
        longest({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096})
        == 16384
    )
    # Without an original context, YaRN stretches the config's own.
    assert longest({"rope_type": "yarn", "factor": 4.0}) == 32768
    assert rope_settings({"max_position_embeddings": 8192, "rope_scaling": {"type": "yarn", "factor": 2}})[
        1
    ]["original_max_position_embeddings"] == 8192  # fmt: skip


def test_unsupported_or_incomplete_scalings_are_refused():
    with pytest.raises(ValueError, match="'dynamic' is not supported.*yarn"):
        check_rope_scaling({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    with pytest.raises(ValueError, match="'yarn' needs a factor"):
        check_rope_scaling({"rope_scaling": {"rope_type": "yarn"}})
    check_rope_scaling({"rope_scaling": QWEN3_YARN})
    check_rope_scaling({})


def test_the_flags_parse_into_overrides():
    overrides = parse_hf_overrides('{"max_position_embeddings": 65536}', json.dumps(QWEN3_YARN))
    assert overrides == {"max_position_embeddings": 65536, "rope_scaling": QWEN3_YARN}
    for args, message in [
        (("{", ""), "--hf-overrides is not JSON"),
        (("[1]", ""), "--hf-overrides must be a JSON object"),
        (("", "yarn"), "--rope-scaling is not JSON"),
        (("", "4"), "--rope-scaling must be a JSON object"),
        (('{"rope_scaling": 4}', ""), "rope_scaling must be a JSON object"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_hf_overrides(*args)
    args = build_parser().parse_args(["--rope-scaling", json.dumps(QWEN3_YARN)])
    assert config_from_args(args).hf_overrides == {"rope_scaling": QWEN3_YARN}
    with pytest.raises(SystemExit, match="pegainfer: --rope-scaling is not JSON"):
        config_from_args(build_parser().parse_args(["--rope-scaling", "{yarn"]))


def _finalized(model_dir: str, overrides: dict, max_model_len: int = 0) -> EngineConfig:
    config = EngineConfig(model_path=model_dir, served_model_name="m", max_model_len=max_model_len)
    config.hf_overrides = overrides
    config.model = read_model_info(model_dir, overrides)
    return finalize(config)


def test_the_context_length_defaults_to_what_the_positions_cover(tiny_qwen3_dir, monkeypatch):
    monkeypatch.delenv(ALLOW_LONG_ENV, raising=False)
    assert _finalized(tiny_qwen3_dir, {}).max_model_len == 4096
    yarn = {"rope_scaling": {**QWEN3_YARN, "original_max_position_embeddings": 4096}}
    assert _finalized(tiny_qwen3_dir, yarn).max_model_len == 16384
    assert _finalized(tiny_qwen3_dir, yarn, 10_000).max_model_len == 10_000
    with pytest.raises(
        ValueError, match="--max-model-len 20000 is longer than the 16384 positions"
    ):
        _finalized(tiny_qwen3_dir, yarn, 20_000)
    with pytest.raises(ValueError, match="--rope-scaling"):
        _finalized(tiny_qwen3_dir, {}, 8192)
    monkeypatch.setenv(ALLOW_LONG_ENV, "1")
    assert _finalized(tiny_qwen3_dir, {}, 8192).max_model_len == 8192


def test_the_worker_reads_the_overrides(tiny_qwen3_dir):
    plain = load_model_config(tiny_qwen3_dir)
    assert plain.rope_scaling is None and plain.rope_theta == 1_000_000.0
    overridden = load_model_config(
        tiny_qwen3_dir, {"rope_scaling": QWEN3_YARN, "rope_theta": 10_000.0}
    )
    assert overridden.rope_scaling == QWEN3_YARN and overridden.rope_theta == 10_000.0
    with pytest.raises(ValueError, match="not supported"):
        load_model_config(tiny_qwen3_dir, {"rope_scaling": {"rope_type": "longrope", "factor": 2}})
