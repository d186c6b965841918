"""The children's bytecode cache (pegainfer/bytecode_cache.py): given where the environment
forbids writing bytecode, and only there; and a real child writing into it once and
reading it on the next start."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pegainfer.bytecode_cache import bytecode_cache_for_children


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PEGAINFER_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "bytecode"


def test_a_forbidding_environment_gets_a_cache_outside_the_sources(cache):
    env = {"PYTHONDONTWRITEBYTECODE": "1", "PATH": "/bin"}
    assert bytecode_cache_for_children(env) == str(cache)
    assert env == {"PYTHONPYCACHEPREFIX": str(cache), "PATH": "/bin"}
    assert cache.is_dir()


@pytest.mark.parametrize(
    "env",
    [
        {},  # Python writes its own __pycache__
        {"PYTHONDONTWRITEBYTECODE": ""},  # empty: not set, for Python too
        {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": "/elsewhere"},
        {"PYTHONDONTWRITEBYTECODE": "1", "PEGAINFER_BYTECODE_CACHE": "0"},
    ],
    ids=["writes-itself", "empty", "own-prefix", "turned-off"],
)
def test_other_environments_are_left_alone(cache, env):
    before = dict(env)
    assert bytecode_cache_for_children(env) is None
    assert env == before
    assert not cache.exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_an_unwritable_cache_leaves_the_environment_alone(cache):
    cache.mkdir(parents=True)
    cache.chmod(0o500)
    try:
        env = {"PYTHONDONTWRITEBYTECODE": "1"}
        assert bytecode_cache_for_children(env) is None
        assert env == {"PYTHONDONTWRITEBYTECODE": "1"}
    finally:
        cache.chmod(0o700)


def test_a_child_writes_its_bytecode_once_and_reads_it_after(cache, tmp_path):
    module = tmp_path / "src" / "bytecode_probe.py"
    module.parent.mkdir()
    module.write_text("VALUE = 41 + 1\n")
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", PYTHONPATH=str(module.parent))
    env.pop("PYTHONPYCACHEPREFIX", None)
    env.pop("PEGAINFER_BYTECODE_CACHE", None)
    assert bytecode_cache_for_children(env) == str(cache)
    probe = "import bytecode_probe, sys; print(bytecode_probe.VALUE, sys.pycache_prefix)"
    written_at = []
    for _ in range(2):
        out = subprocess.run(
            [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.split() == ["42", str(cache)]
        written = list(cache.rglob("bytecode_probe*.pyc"))
        assert len(written) == 1, written
        written_at.append(written[0].stat().st_mtime_ns)
    assert written_at[0] == written_at[1]  # the second start read it, and wrote nothing
    assert not (module.parent / "__pycache__").exists()  # the source tree stays clean
