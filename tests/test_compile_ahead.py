"""Compiling Triton kernels ahead (kernels/compile_ahead.py), the mechanism: where it can
run, its threads and forked children, a child that fails, hangs or cannot fork, unfinished
compiles taken back out, and a finished pass noted in the cache under its fingerprint. The
passes of a worker's start-up are in test_compile_ahead_start_up.py."""

from __future__ import annotations

import inspect
import os
from contextlib import contextmanager

import pytest
import torch
import triton_test_util  # noqa: F401  (Triton's interpreter without CUDA, before the marks below)

from kernels import compile_ahead, compile_child


def test_nothing_is_compiled_ahead_where_it_cannot_be(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not compile_ahead.available()
    ran = []
    assert compile_ahead.compile_for(lambda: ran.append(1), "test") is None
    assert ran == []  # the caller's real run compiles as it goes
    with pytest.raises(RuntimeError, match="asynchronous compile mode"):
        with compile_ahead.compile_ahead():
            pass
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setenv("PEGAINFER_COMPILE_AHEAD", "0")
    assert compile_ahead.compile_for(lambda: ran.append(1), "test") is None
    assert ran == []


def test_thread_count_follows_the_environment(monkeypatch):
    monkeypatch.setenv("PEGAINFER_COMPILE_THREADS", "3")
    assert compile_ahead.default_threads() == 3
    monkeypatch.delenv("PEGAINFER_COMPILE_THREADS")
    assert 1 <= compile_ahead.default_threads() <= compile_ahead.MAX_FORKED


def test_forked_compiles_follow_the_environment(monkeypatch):
    monkeypatch.setenv("PEGAINFER_COMPILE_FORK", "0")
    assert not compile_ahead.forking()
    assert compile_ahead.default_threads() <= compile_ahead.MAX_THREADS
    monkeypatch.delenv("PEGAINFER_COMPILE_FORK")
    assert compile_ahead.forking() == hasattr(os, "fork")
    assert compile_ahead.default_threads() <= compile_ahead.MAX_FORKED


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_does_the_work_and_reports_how_it_ended(tmp_path):
    written = tmp_path / "out"
    state = []

    def work():
        state.append("child")  # a change to the child's memory only
        written.write_text(str(os.getpid()))

    assert compile_child.compiled_in_child(work)
    assert int(written.read_text()) != os.getpid()
    assert state == []

    def failing():
        raise ValueError("the compile failed")

    assert not compile_child.compiled_in_child(failing)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_compile_is_loaded_by_its_thread_and_a_failed_one_redone(tmp_path, monkeypatch):
    """The child fills the cache; the thread's own compile then only reads it. Where the child
    fails, the thread compiles, and raises the real error."""
    cache = tmp_path / "cache"
    compiles = []

    def compile_kernel():
        compiles.append(os.getpid())
        if not cache.exists():
            cache.write_text(str(os.getpid()))
        return "kernel"

    monkeypatch.setattr(compile_ahead, "_build_launcher", lambda kernel: None)
    assert compile_ahead._compile_with_launcher(compile_kernel, forked=True) == "kernel"
    assert int(cache.read_text()) != os.getpid()  # the child compiled
    assert compiles == [os.getpid()]  # the thread only loaded

    def broken():
        raise RuntimeError("bad kernel")

    with pytest.raises(RuntimeError, match="bad kernel"):
        compile_ahead._compile_with_launcher(broken, forked=True)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_stuck_child_is_killed_at_the_bound_and_its_thread_compiles(monkeypatch, caplog):
    """A child that never finishes (as one blocked on a lock held at the fork would) is
    killed once ``CHILD_TIMEOUT_S`` has passed, with a warning; the thread then compiles."""
    import time

    monkeypatch.setattr(compile_child, "CHILD_SLOW_S", 0.2)
    monkeypatch.setattr(compile_child, "CHILD_TIMEOUT_S", 0.5)
    started = time.monotonic()
    with caplog.at_level("WARNING", logger="kernels.compile_child"):
        assert not compile_child.compiled_in_child(lambda: time.sleep(60))
    assert time.monotonic() - started < 10
    messages = [r.getMessage() for r in caplog.records if r.name == "kernels.compile_child"]
    assert len(messages) == 2, messages  # named once while slow, then killed
    assert "still runs" in messages[0] and "killed" in messages[1]
    monkeypatch.setattr(compile_ahead, "_build_launcher", lambda kernel: None)
    monkeypatch.setattr(compile_child, "compiled_in_child", lambda work: False)
    assert compile_ahead._compile_with_launcher(lambda: "kernel", forked=True) == "kernel"


def test_a_refused_fork_leaves_the_compile_to_the_thread(monkeypatch):
    def refuse():
        raise RuntimeError("os.fork is unsafe while another library changes its state")

    monkeypatch.setattr(os, "fork", refuse)
    ran = []
    assert not compile_child.compiled_in_child(lambda: ran.append(1))
    assert ran == []
    monkeypatch.setattr(compile_ahead, "_build_launcher", lambda kernel: None)
    assert compile_ahead._compile_with_launcher(lambda: "kernel", forked=True) == "kernel"


def test_unfinished_compiles_are_taken_out_of_the_kernel_caches():
    """A pass that fails leaves no pending compile where the next launch would meet its
    error; a finished compile, and an entry replaced since, stay."""

    class Pending:
        def __init__(self, kernel=None):
            self.kernel = kernel

    failed, finished, replaced = Pending(), Pending("compiled"), Pending()
    cache = {"failed": failed, "finished": finished, "replaced": "a kernel compiled since"}
    compile_ahead._forget_unfinished(
        [(cache, "failed", failed), (cache, "finished", finished), (cache, "replaced", replaced)]
    )
    assert cache == {"finished": finished, "replaced": "a kernel compiled since"}


@pytest.mark.skipif(not compile_ahead.available(), reason="needs Triton's asynchronous mode")
@pytest.mark.parametrize("fork", ["1", "0"])
def test_a_failed_compile_fails_the_block_and_leaves_no_mode_behind(monkeypatch, fork):
    """Triton's asynchronous mode, whose exit raises a failed compile's error, must not stay
    active after the block: every later compile would go to the closed pool."""
    from triton.runtime._async_compile import active_mode

    monkeypatch.setenv("PEGAINFER_COMPILE_FORK", fork)

    def failing():
        raise ValueError("the compile failed")

    with pytest.raises(ValueError, match="the compile failed"):
        with compile_ahead.compile_ahead(threads=2):
            mode = active_mode.get()
            hooks = [lambda kernel: None]
            if "cleanup_fn" in inspect.signature(mode.submit).parameters:  # newer Triton
                hooks.append(lambda future_kernel: None)
            mode.submit("a kernel", failing, *hooks)
    assert active_mode.get() is None
    with compile_ahead.compile_ahead(threads=2) as report:  # the next block starts cleanly
        pass
    assert report.variants == 0


def test_a_pass_noted_in_the_cache_is_not_run_again(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compile_ahead, "available", lambda: True)

    @contextmanager
    def caught(threads=None):
        yield compile_ahead.CompileAheadReport(threads=1)

    monkeypatch.setattr(compile_ahead, "compile_ahead", caught)
    runs = []
    assert compile_ahead.compile_for(lambda: runs.append("a"), "test", "key-a") is not None
    assert compile_ahead.compile_for(lambda: runs.append("a"), "test", "key-a") is None
    assert compile_ahead.compile_for(lambda: runs.append("b"), "test", "key-b") is not None
    assert runs == ["a", "b"]

    def failing():
        runs.append("c")
        raise ValueError("a kernel failed to compile")

    assert compile_ahead.compile_for(failing, "test", "key-c") is None
    assert compile_ahead.compile_for(failing, "test", "key-c") is None  # not noted: tried again
    assert runs == ["a", "b", "c", "c"]


def test_the_fingerprint_follows_the_model_and_the_settings(monkeypatch):
    model = torch.nn.Linear(8, 4)
    key = compile_ahead.fingerprint("graphs", model, 12, 256)
    assert key == compile_ahead.fingerprint("graphs", model, 12, 256)
    assert key != compile_ahead.fingerprint("graphs", model, 16, 256)
    assert key != compile_ahead.fingerprint("profile", model, 12, 256)
    assert key != compile_ahead.fingerprint("graphs", torch.nn.Linear(8, 5), 12, 256)
    assert key != compile_ahead.fingerprint("graphs", model.to(torch.float16), 12, 256)
    model = torch.nn.Linear(8, 4)
    key = compile_ahead.fingerprint("graphs", model)
    # Each launch gives its children another parent pid; a kernel setting changes the key.
    monkeypatch.setenv("PEGAINFER_PARENT_PID", str(os.getpid() + 1))
    assert compile_ahead.fingerprint("graphs", model) == key
    monkeypatch.setenv("PEGAINFER_BYTECODE_CACHE", "0")  # picks no kernel either
    assert compile_ahead.fingerprint("graphs", model) == key
    monkeypatch.setenv("PEGAINFER_PDL", "0")
    assert compile_ahead.fingerprint("graphs", model) != key
