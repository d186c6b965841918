"""Models named by their Hugging Face Hub id, served from the local hub cache, and the
model given first on the command line."""

from __future__ import annotations

import os

import pytest

from pegainfer.cli import build_parser, config_from_args
from pegainfer.hub_cache import hub_cache_dir, is_repo_id, resolve_model_path
from tests.server_util import Server

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OLDER = "fedcba9876543210fedcba9876543210fedcba98"


def cache_with(root, repo_id: str, source_dir: str) -> str:
    """The hub client's layout: refs/main names a commit, snapshots/<commit> links to blobs."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    (repo / "refs" / "v1").write_text(OLDER)
    for commit in (COMMIT, OLDER):
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True)
        for name in os.listdir(source_dir):
            os.symlink(os.path.join(source_dir, name), snapshot / name)
    return str(root)


def test_the_cache_is_found_by_the_hub_clients_variables(monkeypatch, tmp_path):
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert hub_cache_dir() == str(tmp_path / ".cache" / "huggingface" / "hub")
    monkeypatch.setenv("HF_HOME", "/data/hf")
    assert hub_cache_dir() == "/data/hf/hub"
    monkeypatch.setenv("HF_HUB_CACHE", "/fast/hub")
    assert hub_cache_dir() == "/fast/hub"


def test_names_paths_and_revisions(monkeypatch, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    monkeypatch.setenv("HF_HUB_CACHE", cache_with(tmp_path / "hub", "org/tiny", str(model)))
    snapshots = tmp_path / "hub" / "models--org--tiny" / "snapshots"
    assert resolve_model_path("org/tiny") == str(snapshots / COMMIT)
    assert resolve_model_path("org/tiny", "v1") == str(snapshots / OLDER)
    assert resolve_model_path("org/tiny", OLDER) == str(snapshots / OLDER)
    # Paths stay paths, even ones that look like a name.
    monkeypatch.chdir(tmp_path)
    assert not is_repo_id("model") and not is_repo_id("/abs/dir") and not is_repo_id("./a/b")
    os.makedirs("org2/local")
    assert resolve_model_path("org2/local") == "org2/local"
    with pytest.raises(FileNotFoundError, match="huggingface-cli download org/other"):
        resolve_model_path("org/other")
    with pytest.raises(FileNotFoundError, match="--revision v9"):
        resolve_model_path("org/tiny", "v9")


def test_the_model_may_come_first_as_in_other_servers_commands():
    assert config_from_args(build_parser().parse_args(["org/m"])).model_path == "org/m"
    assert config_from_args(build_parser().parse_args(["--model-path", "d"])).model_path == "d"
    with pytest.raises(SystemExit, match="two models given"):
        config_from_args(build_parser().parse_args(["org/m", "--model-path", "d"]))


@pytest.mark.slow
def test_a_hub_name_serves_the_cached_snapshot_under_that_name(tiny_qwen3_dir, tmp_path):
    cache = cache_with(tmp_path / "hub", "test-org/tiny-qwen3", tiny_qwen3_dir)
    server = Server(
        "test-org/tiny-qwen3", "--device", "cpu", "--kv-cache-memory", "64MiB",
        "--max-model-len", "128", "--revision", "v1",
        # The rest of a command line as other servers' docs give it for Qwen3.
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
        log_path=str(tmp_path / "pegainfer.log"), env={"HF_HUB_CACHE": cache},
    ).wait_ready()  # fmt: skip
    try:
        status, models = server.get("/v1/models")
        assert status == 200 and [m["id"] for m in models["data"]] == ["test-org/tiny-qwen3"]
        assert models["data"][0]["root"].endswith(f"snapshots/{OLDER}")
        body = {"model": "test-org/tiny-qwen3", "prompt": "Hi", "max_tokens": 2}
        status, out = server.post("/v1/completions", body)
        assert status == 200 and out["usage"]["completion_tokens"] == 2, out
    finally:
        assert server.stop() == 0, server.log()[-3000:]
        assert server.leftovers() == []
