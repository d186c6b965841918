"""Default sampling settings: what a request gets for the fields it leaves out.

A model's ``generation_config.json`` names the settings its authors tuned it for (Qwen3:
temperature 0.6, top-p 0.95, top-k 20). By default the server reads them there, so a client
that sends no sampling fields gets the model's own behaviour; ``--generation-config none``
keeps the API's neutral defaults (temperature 1, no filters), and
``--override-generation-config`` sets any of them by hand. A request's own fields always
win, except over ``max_new_tokens``: that one is a ceiling on every request's ``max_tokens``
(vLLM reads it the same way). ``do_sample`` is not read: a client asks for greedy decoding
with temperature 0.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any

from frontend_proc.errors import APIError
from frontend_proc.fields import MAX_INT32, get_float, get_int

GENERATION_CONFIG_FILE = "generation_config.json"
# --generation-config's values besides a path.
FROM_MODEL = "auto"
NEUTRAL = "none"


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_new_tokens: int | None = None  # None: no ceiling but the context window

    def changed(self) -> dict[str, float | int]:
        """The settings that differ from the API's neutral defaults."""
        neutral = asdict(SamplingDefaults())
        return {name: value for name, value in asdict(self).items() if value != neutral[name]}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SamplingDefaults:
        return cls(**{name: values[name] for name in asdict(cls()) if name in values})


def read_setting(values: dict[str, Any], name: str) -> float | int | None:
    """One setting, held to the bounds a request's field has; None when absent."""
    if name == "top_k":
        top_k = get_int(values, name, None, lo=-1, hi=MAX_INT32)
        return -1 if top_k == 0 else top_k  # 0 and -1 both mean "off", as in a request
    if name == "max_new_tokens":
        return get_int(values, name, None, lo=1, hi=MAX_INT32)
    bounds = {
        "temperature": {"lo": 0.0, "hi": 2.0},
        "top_p": {"lo": 0.0, "hi": 1.0, "lo_open": True},
        "min_p": {"lo": 0.0, "hi": 1.0},
        "repetition_penalty": {"lo": 0.0, "hi": 2.0, "lo_open": True},
    }[name]
    return get_float(values, name, None, **bounds)


def read_settings(values: dict[str, Any], strict: bool) -> tuple[dict[str, Any], list[str]]:
    """The settings ``values`` names, and a note for each one refused. ``strict`` raises on
    the first refused one instead (settings typed on the command line)."""
    settings: dict[str, Any] = {}
    notes: list[str] = []
    for name in asdict(SamplingDefaults()):
        try:
            value = read_setting(values, name)
        except APIError as exc:
            if strict:
                raise ValueError(exc.message) from None
            notes.append(f"{exc.message}; ignored")
            continue
        if value is not None:
            settings[name] = value
    return settings, notes


def parse_override(text: str) -> dict[str, Any]:
    """--override-generation-config's JSON object, checked now rather than at a request."""
    if not text:
        return {}
    try:
        values = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--override-generation-config is not JSON: {exc}") from None
    if not isinstance(values, dict):
        raise ValueError("--override-generation-config must be a JSON object")
    known = set(asdict(SamplingDefaults()))
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(
            f"--override-generation-config: unknown setting(s) {', '.join(unknown)} "
            f"(known: {', '.join(sorted(known))})"
        )
    settings, _ = read_settings(values, strict=True)
    return settings


def _config_file(source: str, model_path: str) -> str | None:
    if source == NEUTRAL:
        return None
    folder = model_path if source == FROM_MODEL else source
    if os.path.isfile(folder):
        return folder
    path = os.path.join(folder, GENERATION_CONFIG_FILE)
    if os.path.isfile(path):
        return path
    if source != FROM_MODEL:
        raise ValueError(f"--generation-config {source}: no {GENERATION_CONFIG_FILE} there")
    return None


def resolve_sampling_defaults(
    source: str, model_path: str, override: dict[str, Any]
) -> tuple[dict[str, Any], list[str]]:
    """The server's defaults (only the settings that differ from the API's neutral ones)
    and notes for the log. ``source`` is --generation-config: "auto" (the model's folder),
    "none", or a folder or file path."""
    path = _config_file(source, model_path)
    settings: dict[str, Any] = {}
    notes: list[str] = []
    if path is not None:
        try:
            with open(path) as f:
                values = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read {path}: {exc}") from None
        if not isinstance(values, dict):
            raise ValueError(f"{path} does not hold a JSON object")
        settings, refused = read_settings(values, strict=False)
        notes += [f"{path}: {note}" for note in refused]
    settings.update(override)
    defaults = SamplingDefaults.from_dict(settings)
    changed = defaults.changed()
    if changed:
        origin = path or "the command line"
        if path and override:
            origin = f"{path} and --override-generation-config"
        listed = ", ".join(f"{name}={value}" for name, value in changed.items())
        notes.append(
            f"default sampling from {origin}: {listed} (a request's own fields take "
            "precedence; --generation-config none keeps the neutral defaults)"
        )
    return changed, notes
