"""Structured output where xgrammar cannot be loaded: the first constrained request learns
why, every later one is refused at once with the same 400, nothing retries the load, and
no failed load freezes the process's garbage into the permanent generation; a missing
dependency is named, and found from package metadata before any request."""

from __future__ import annotations

import gc
import sys

import pytest

from pegainfer.config import read_model_info
from pegainfer.protocol import StructuredOutput
from scheduler_proc.grammar import GrammarCompiler, GrammarError
from scheduler_proc.grammar_install import missing_requirements
from scheduler_proc.scheduler import Scheduler
from tests.scheduler_sim import make_config
from tests.test_structured_output import request, settle


@pytest.fixture
def no_xgrammar(monkeypatch):
    """``import xgrammar`` fails, as where the package is not installed; counts the loads."""
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    loads = []
    make_compiler = GrammarCompiler._make_compiler

    def counted(self):
        loads.append(1)
        return make_compiler(self)

    monkeypatch.setattr(GrammarCompiler, "_make_compiler", counted)
    return loads


def test_every_constrained_request_gets_the_same_400_and_the_load_is_tried_once(
    tiny_qwen3_dir, no_xgrammar
):
    model = read_model_info(tiny_qwen3_dir)
    scheduler = Scheduler(
        make_config(model_path=tiny_qwen3_dir, model=model, max_model_len=256, num_kv_blocks=64)
    )
    # The first one is accepted and waits for its compile, which finds no xgrammar.
    assert scheduler.add_request(request("first", StructuredOutput("regex", "[ab]+"))) is None
    (first,) = settle(scheduler)
    assert first.request_id == "first" and first.status == 400
    assert "xgrammar" in first.message and "pip install" in first.message
    # Later ones are refused on arrival, with no compile started.
    for n, structured in enumerate(
        (StructuredOutput("choice", '["x", "y"]'), StructuredOutput("json_object", "{}"))
    ):
        rejection = scheduler.add_request(request(f"later-{n}", structured))
        assert rejection is not None and rejection.status == 400
        assert rejection.message == first.message and rejection.param == "response_format"
        assert scheduler.num_compiling == 0
    assert len(no_xgrammar) == 1
    # An unconstrained request is served as ever.
    assert scheduler.add_request(request("plain", None)) is None
    assert scheduler.num_waiting == 1


def test_a_failed_load_freezes_nothing(no_xgrammar):
    class Cycle:
        def __init__(self) -> None:
            self.me = self

    gc.freeze()  # as the scheduler process freezes its start-up heap
    try:
        frozen = gc.get_freeze_count()
        compiler = GrammarCompiler("/nonexistent", 1000, [2])
        for attempt in range(20):
            for _ in range(50):
                Cycle()  # garbage that a freeze at this point would keep for good
            with pytest.raises(GrammarError, match="xgrammar"):
                compiler.submit(StructuredOutput("regex", f"[a-z]{{{attempt + 1}}}")).future.result(
                    timeout=30
                )
        # Frozen objects that die leave the count: it may fall, never grow.
        assert gc.get_freeze_count() <= frozen
        compiler.shutdown()
    finally:
        gc.unfreeze()


def test_a_missing_dependency_is_named(tiny_qwen3_dir, monkeypatch):
    """xgrammar installed without its dependencies (``--no-deps``) fails on one of them: the
    400 names that one, not xgrammar, as what is missing."""

    def fails(self):
        raise ModuleNotFoundError("No module named 'pydantic'", name="pydantic")

    monkeypatch.setattr(GrammarCompiler, "_make_compiler", fails)
    model = read_model_info(tiny_qwen3_dir)
    scheduler = Scheduler(
        make_config(model_path=tiny_qwen3_dir, model=model, max_model_len=256, num_kv_blocks=64)
    )
    assert scheduler.add_request(request("r", StructuredOutput("regex", "[ab]+"))) is None
    (rejection,) = settle(scheduler)
    assert rejection.status == 400
    assert "dependency 'pydantic'" in rejection.message
    assert "with its dependencies" in rejection.message


def _fake_distribution(root, name: str, requires: list[str]) -> None:
    info = root / f"{name}-1.0.dist-info"
    info.mkdir()
    lines = [f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0"]
    lines += [f"Requires-Dist: {line}" for line in requires]
    (info / "METADATA").write_text("\n".join(lines) + "\n")


def test_missing_requirements_reads_the_metadata(tmp_path, monkeypatch):
    _fake_distribution(
        tmp_path,
        "pegainfer_fake_grammar",
        [
            "pegainfer-fake-absent>=1",
            "packaging",
            "pegainfer-fake-extra; extra == 'test'",
            "pegainfer-fake-elsewhere; platform_system == 'Plan9'",
        ],
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert missing_requirements("pegainfer_fake_grammar") == ["pegainfer-fake-absent"]
    assert missing_requirements("pegainfer-fake-not-installed") == ["pegainfer-fake-not-installed"]
    # This environment has xgrammar and all it needs (the project's dependencies).
    assert missing_requirements() == []
