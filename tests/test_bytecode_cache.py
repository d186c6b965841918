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


def _tree(root, files):
    for name in files:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"VALUE = {name!r}\n")


def test_the_filler_takes_each_package_shallowest_first_without_the_skipped_parts(tmp_path):
    from pegainfer.bytecode_warm import source_files

    torch_root, other_root, stdlib = tmp_path / "torch", tmp_path / "other", tmp_path / "lib"
    _tree(torch_root, ["a/deep/x.py", "__init__.py", "nn/m.py", "_inductor/big.py"])
    _tree(torch_root, ["testing/_internal/h.py", "testing/t.py", "tests/test_a.py"])
    _tree(other_root, ["__init__.py", "README.txt"])
    _tree(stdlib, ["os2.py", "idlelib/x.py", "json2/__init__.py"])
    files = source_files([("torch", str(torch_root)), ("other", str(other_root))], str(stdlib))
    relative = [os.path.relpath(f, tmp_path) for f in files]
    assert relative == [
        "torch/__init__.py",
        "torch/nn/m.py",
        "torch/testing/t.py",
        "torch/a/deep/x.py",
        "other/__init__.py",
        "lib/os2.py",
        "lib/json2/__init__.py",
    ]


def test_the_filler_compiles_into_the_cache_once_and_leaves_its_marker(tmp_path):
    package = tmp_path / "src" / "probe_pkg"
    _tree(package, ["__init__.py", "sub/mod.py", "broken.py"])
    (package / "broken.py").write_text("def (\n")  # its importer would report it
    cache = tmp_path / "cache"
    cache.mkdir()
    code = (
        "import sys; from pegainfer import bytecode_warm as w; "
        f"print(*w.fill({str(cache)!r}, 2, [('probe_pkg', {str(package)!r})], None))"
    )
    env = dict(os.environ, PYTHONPYCACHEPREFIX=str(cache))
    env.pop("PYTHONDONTWRITEBYTECODE", None)

    def run() -> int:
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        return int(out.stdout.split()[0])

    assert run() == 2  # the two good files; the broken one is left to its importer
    # (The filler's own imports are cached there too, under their own sources' paths.)
    mirrored = cache / str(package).lstrip(os.sep)
    compiled = sorted(p.name for p in mirrored.rglob("*.pyc"))
    assert compiled == [
        f"__init__.{sys.implementation.cache_tag}.pyc",
        f"mod.{sys.implementation.cache_tag}.pyc",
    ]
    from pegainfer.bytecode_cache import filled_note
    from pegainfer.bytecode_warm import marker

    assert os.path.exists(marker(str(cache)))
    assert filled_note(str(cache)).startswith("filled ahead: 2 of 3 files compiled in ")
    assert run() == 0  # already there


def test_a_first_start_fills_the_cache_where_cpus_are_to_spare(tmp_path, monkeypatch):
    import pegainfer.bytecode_cache as bytecode_cache
    from pegainfer.bytecode_warm import marker

    started = []

    class FakePopen:
        pid = 4242

        def __init__(self, command, **kwargs):
            started.append((command, kwargs["env"]))

    monkeypatch.setattr(bytecode_cache.subprocess, "Popen", FakePopen)
    directory = str(tmp_path)
    env = {"PYTHONPYCACHEPREFIX": directory}
    assert bytecode_cache.start_filling(directory, env, cpus=4) is None  # none to spare
    assert bytecode_cache.start_filling(directory, env, cpus=5) is None  # one: not worth it
    filler, processes = bytecode_cache.start_filling(directory, env, cpus=16)
    assert processes == bytecode_cache.FILL_PROCESSES and filler.pid == 4242
    command, child_env = started[-1]
    assert command[1:] == ["-m", "pegainfer.bytecode_warm", directory, "8"]
    assert child_env is env
    assert (
        bytecode_cache.start_filling(directory, {**env, "PEGAINFER_BYTECODE_FILL": "3"}, cpus=2)[1]
        == 3
    )
    assert (
        bytecode_cache.start_filling(directory, {**env, "PEGAINFER_BYTECODE_FILL": "0"}, cpus=16)
        is None
    )
    open(marker(directory), "w").close()
    assert bytecode_cache.start_filling(directory, env, cpus=16) is None  # filled already
    assert len(started) == 2
