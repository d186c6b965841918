"""A model's config.json as the engine reads it: the file, the user's overrides on top
(``--hf-overrides``, ``--rope-scaling``), and the context length its positions allow.

The launcher and every worker read the model's settings through here, so that an override
reaches each of them alike. Plain JSON: no torch, no transformers.
"""

from __future__ import annotations

import json
import os
from typing import Any

# What the rotary embedding implements (worker_proc/layers/rope_scaling.py); a config
# naming any other type is refused at start-up rather than served with wrong positions.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def read_hf_config(model_path: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """config.json of ``model_path`` with ``overrides`` applied and a multimodal wrapper's
    ``text_config`` lifted to the top."""
    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{model_path} has no config.json; is it a model directory?")
    with open(path) as f:
        hf = json.load(f)
    hf = apply_overrides(hf, overrides or {})
    if "text_config" in hf:
        hf = {**hf, **hf["text_config"]}
    return hf


def apply_overrides(hf: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``hf`` updated key by key from ``overrides``. In a config of transformers 5's form,
    whose ``rope_parameters`` hold the theta and the scaling together, a ``rope_theta`` or
    ``rope_scaling`` override goes there too, so that it wins whichever form the file uses."""
    merged = {**hf, **overrides}
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "rope_parameters" not in overrides:
        theta = overrides.get("rope_theta", params.get("rope_theta"))
        scaling = overrides.get("rope_scaling")
        if isinstance(scaling, dict):
            merged["rope_parameters"] = {**scaling, "rope_theta": theta}
        elif "rope_theta" in overrides:
            merged["rope_parameters"] = {**params, "rope_theta": theta}
    return merged


def rope_settings(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, scaling)`` from either form of the config; ``scaling`` is None for
    plain rotary embeddings."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        theta, scaling = float(params["rope_theta"]), params
    else:
        theta, scaling = float(hf.get("rope_theta", 10000.0)), hf.get("rope_scaling")
    if not isinstance(scaling, dict) or rope_type(scaling) == "default":
        return theta, None
    scaling = {key: value for key, value in scaling.items() if key != "rope_theta"}
    if rope_type(scaling) in ("llama3", "yarn"):
        # As transformers reads it: the pretraining context is the config's, unless given.
        scaling.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
    return theta, scaling


def rope_type(scaling: dict[str, Any] | None) -> str:
    if not scaling:
        return "default"
    return str(scaling.get("rope_type") or scaling.get("type") or "default")


def check_rope_scaling(hf: dict[str, Any]) -> None:
    """Raise ValueError for a scaling the engine cannot apply or that lacks a field."""
    _, scaling = rope_settings(hf)
    kind = rope_type(scaling)
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope scaling type {kind!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if scaling is not None and scaling.get("factor") is None:
        raise ValueError(f"rope scaling {kind!r} needs a factor")


def max_context_len(hf: dict[str, Any]) -> int:
    """The longest context the model's positions cover: ``max_position_embeddings``, or
    with YaRN the original context times its factor (Qwen3: 32,768 x 4), with linear
    scaling the context times its factor. llama3 scaling's config already gives the
    extended length."""
    max_position = int(hf.get("max_position_embeddings", 2048))
    _, scaling = rope_settings(hf)
    kind = rope_type(scaling)
    if scaling is None or kind not in ("yarn", "linear"):
        return max_position
    factor = float(scaling.get("factor", 1.0))
    if kind == "yarn":
        original = int(scaling.get("original_max_position_embeddings") or max_position)
        return max(max_position, int(original * factor))
    return int(max_position * factor)


def parse_hf_overrides(hf_overrides: str, rope_scaling: str = "") -> dict[str, Any]:
    """The overrides of ``--hf-overrides`` (a JSON object of config.json keys) and
    ``--rope-scaling`` (a JSON object, shorthand for ``{"rope_scaling": ...}``), checked
    now: ValueError names the flag at fault."""
    overrides: dict[str, Any] = {}
    for flag, text in (("--hf-overrides", hf_overrides), ("--rope-scaling", rope_scaling)):
        if not text:
            continue
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{flag} is not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"{flag} must be a JSON object")
        overrides.update(value if flag == "--hf-overrides" else {"rope_scaling": value})
    scaling = overrides.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise ValueError("rope_scaling must be a JSON object")
    return overrides
