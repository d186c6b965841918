"""A model named as on the Hugging Face Hub (``Qwen/Qwen3-4B``), found in the local hub cache
that ``huggingface-cli download`` (or any earlier ``from_pretrained``) fills. pegainfer never
downloads: a name that is not in the cache is an error that says how to fetch it."""

from __future__ import annotations

import os
import re

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_COMMIT = re.compile(r"[0-9a-f]{40}")


def hub_cache_dir() -> str:
    """Where the Hub's client keeps its downloads, by the same variables it reads."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return os.path.expanduser(os.environ[name])
    home = os.environ.get("HF_HOME")
    if not home:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
        home = os.path.join(cache, "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def is_repo_id(name: str) -> bool:
    """``owner/name`` that is not a path on this machine."""
    return bool(_REPO_ID.fullmatch(name)) and not os.path.exists(name)


def resolve_model_path(name: str, revision: str = "main") -> str:
    """``name`` itself when it is a path (or not a Hub name), else the cached snapshot of
    that repository at ``revision`` (a branch, tag or commit). Raises FileNotFoundError."""
    if not is_repo_id(name):
        return name
    cache = hub_cache_dir()
    repo = os.path.join(cache, "models--" + name.replace("/", "--"))
    ref = os.path.join(repo, "refs", revision)
    commit = revision if _COMMIT.fullmatch(revision) else None
    if os.path.isfile(ref):
        with open(ref) as f:
            commit = f.read().strip()
    snapshot = os.path.join(repo, "snapshots", commit) if commit else ""
    if snapshot and os.path.isfile(os.path.join(snapshot, "config.json")):
        return snapshot
    where = f"{name} at revision {revision}" if revision != "main" else name
    raise FileNotFoundError(
        f"{name} is not a directory here, and the Hugging Face cache ({cache}) has no copy of "
        f"{where}. pegainfer does not download models: fetch it first "
        f"(huggingface-cli download {name}"
        + (f" --revision {revision}" if revision != "main" else "")
        + ") or give its directory"
    )
