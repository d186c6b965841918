"""The resident memory of the light processes: start-up's freed heap is handed back, and of
the real tree on the Qwen3 tokenizer only the tokenizer process holds a tokenizer (the
frontend none, the detokenizer a byte table)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from tests.server_util import Server

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MB = 1e6
# Idle PSS measured with the Qwen3 tokenizer: frontend 33 MB, detokenizer 23, tokenizer 69
# (each ~120-145 MB while all three held a tokenizer). The bounds leave room for other
# library versions but not for a tokenizer creeping back.
PSS_LIMITS_MB = {"frontend": 80, "detokenizer": 60, "tokenizer-0": 105}

_FRAGMENT_AND_RELEASE = """
import os
from pegainfer.process import release_free_heap

def resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

blocks = [bytes(2000) for _ in range(40_000)]  # ~80 MB from malloc
survivors = blocks[::64]  # one live block every 128 KB: free() cannot shrink the heap
del blocks
before = resident()
release_free_heap()
print(before - resident())
"""


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)
def test_release_free_heap_returns_the_holes_between_live_blocks():
    out = subprocess.run(
        [sys.executable, "-c", _FRAGMENT_AND_RELEASE],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert int(out.stdout) > 40 * MB


@pytest.mark.slow
def test_idle_tree_keeps_one_tokenizer(tiny_qwen3_dir, tmp_path):
    server = Server(
        "--model-path", tiny_qwen3_dir, "--kv-cache-memory", "64MiB",
        "--max-model-len", "256", log_path=str(tmp_path / "pegainfer.log"),
    ).wait_ready()  # fmt: skip
    try:
        assert server.run_dir is not None
        with open(os.path.join(server.run_dir, "config.json")) as f:
            # The tokenizer told the launcher, for the frontend, that Qwen3 thinks aloud.
            assert json.load(f)["reasoning"] is True
        children = server.children()
        pss = {}
        for name in PSS_LIMITS_MB:
            process = children[f"pegainfer::{name}"]
            pss[name] = process.memory_full_info().pss / MB
            with open(f"/proc/{process.pid}/maps") as f:
                has_tokenizers = "tokenizers" in f.read()
            assert has_tokenizers == (name != "frontend"), name
        assert all(pss[name] <= limit for name, limit in PSS_LIMITS_MB.items()), pss
        assert "decoding with ByteLevelVocab" in server.log()
        status, body = server.post("/tokenize", {"prompt": "Hello 世界"})
        assert status == 200 and body["count"] == len(body["tokens"]) > 1
    finally:
        assert server.stop() == 0, server.log()[-3000:]
    assert server.leftovers() == []
