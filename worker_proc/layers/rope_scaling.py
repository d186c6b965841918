"""Rotary frequencies of each ``rope_scaling`` type, and the factor cos/sin are scaled by.

- ``default``: ``base ** (-2i / rotary_dim)``.
- ``linear``: every frequency divided by ``factor`` (positions interpolated).
- ``llama3``: low frequencies divided by ``factor``, high ones kept, a smooth ramp between.
- ``yarn``: frequencies that turn fewer than ``beta_slow`` times over the original context
  are interpolated, those that turn more than ``beta_fast`` times are kept, a linear ramp
  between; cos and sin are then scaled by ``attention_factor`` (``0.1 ln(factor) + 1`` unless
  the config gives it, or ``mscale`` / ``mscale_all_dim``). Qwen3 reaches 128k tokens so.

The names and defaults are those of HF transformers' ``rope_parameters``, which the tests
hold these to.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from pegainfer.hf_config import SUPPORTED_ROPE_TYPES, rope_type


def rope_frequencies(
    base: float, rotary_dim: int, scaling: dict[str, Any] | None
) -> tuple[torch.Tensor, float]:
    """``(inv_freq [rotary_dim / 2] float32, attention_factor)`` for ``scaling``."""
    inv_freq = _default_inv_freq(base, rotary_dim)
    kind = rope_type(scaling)
    if kind == "default":
        return inv_freq, 1.0
    assert scaling is not None
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    if kind == "yarn":
        return _yarn_frequencies(base, rotary_dim, scaling)
    raise NotImplementedError(
        f"rope scaling type {kind!r} is not supported (supported: "
        f"{', '.join(SUPPORTED_ROPE_TYPES)})"
    )


def _default_inv_freq(base: float, rotary_dim: int) -> torch.Tensor:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    return 1.0 / (base**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    original_max = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = original_max / low_freq_factor
    high_freq_wavelen = original_max / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are slowed by the full factor, short ones kept, and
    # the band between interpolates smoothly.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_frequencies(
    base: float, rotary_dim: int, scaling: dict[str, Any]
) -> tuple[torch.Tensor, float]:
    factor = float(scaling["factor"])
    original_max = float(scaling["original_max_position_embeddings"])
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def dimension_turning(turns: float) -> float:
        # The dimension pair whose frequency turns ``turns`` times over the original context.
        return rotary_dim * math.log(original_max / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension_turning(beta_fast), dimension_turning(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # a ramp of one step, not a division by zero
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = _default_inv_freq(base, rotary_dim)
    interpolated = extrapolated / factor
    # ramp 0: high frequencies, kept as trained; ramp 1: low ones, interpolated.
    inv_freq = interpolated * ramp + extrapolated * (1 - ramp)
    return inv_freq, float(attention_factor)
