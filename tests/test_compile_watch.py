"""The late-compile watch (kernels/compile_watch.py): Triton's JIT hooks, chained to any hook
already set, name each compile after start-up; on a GPU, a real first launch is caught."""

from __future__ import annotations

import logging
import types

import pytest
import torch

from kernels import compile_watch
from kernels.compile_watch import kernel_name, variant, watch_late_compiles


@pytest.fixture(autouse=True)
def fresh_watch(monkeypatch):
    monkeypatch.setattr(compile_watch, "_watch", None)


def _runtime(before=None, after=None) -> types.SimpleNamespace:
    return types.SimpleNamespace(jit_cache_hook=before, jit_post_compile_hook=after)


def _jit_info(name: str) -> types.SimpleNamespace:
    return types.SimpleNamespace(name=name, module="kernels.x")


def test_each_compile_is_logged_with_its_kernel_and_counted(caplog):
    runtime = _runtime()
    watch = watch_late_compiles("worker-0", runtime)
    assert watch is not None and watch.summary() == "no Triton compiles after start-up"
    with caplog.at_level(logging.WARNING, logger="kernels.compile_watch"):
        for kernel in ("_skinny_gemm_kernel", "_rotary_kernel"):
            assert runtime.jit_cache_hook(key=1, repr=f"{kernel}[num_warps=4]()", fn=None) is None
            runtime.jit_post_compile_hook(
                key=1, repr=f"{kernel}[num_warps=4](num_rows: i32D)", fn=_jit_info(kernel)
            )
    assert [kernel for kernel, _ in watch.compiles] == ["_skinny_gemm_kernel", "_rotary_kernel"]
    assert all(ms >= 0 for _, ms in watch.compiles)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "worker-0: Triton compiled a variant of _rotary_kernel" in lines[1]
    assert (
        "(2 late compiles so far); variant: _rotary_kernel[num_warps=4](num_rows: i32D)" in lines[1]
    )
    summary = watch.summary()
    assert summary.startswith("2 Triton compiles after start-up") and "_rotary_kernel" in summary


def test_hooks_already_set_still_run_and_decide():
    calls = []
    runtime = _runtime(
        before=lambda **kw: calls.append("before") or True,
        after=lambda **kw: calls.append("after"),
    )
    watch_late_compiles("bench", runtime)
    # The earlier cache hook's answer (True: skip the compile) reaches Triton unchanged.
    assert runtime.jit_cache_hook(key=0, fn=_jit_info("k")) is True
    runtime.jit_post_compile_hook(key=0, fn=_jit_info("k"))
    assert calls == ["before", "after"]


def test_one_watch_per_process_and_none_without_hooks():
    runtime = _runtime()
    first = watch_late_compiles("a", runtime)
    assert watch_late_compiles("b", runtime) is first
    compile_watch._watch = None
    assert watch_late_compiles("c", types.SimpleNamespace()) is None


def test_variant_shows_the_specialized_arguments_and_the_options():
    record = {
        "signature": {"x_ptr": "*bf16", "num_rows": "i32", "hidden": "i32", "BLOCK": "constexpr"},
        "constants": {(3,): 4096},
        "configs": [{(0,): [["tt.divisibility", 16]], (2,): [["tt.divisibility", 16]]}],
        "num_warps": 8,
        "num_stages": 3,
    }
    assert variant({"compile": record}) == (
        "(x_ptr: *bf16/16, num_rows: i32, hidden: i32/16, BLOCK=4096) [num_warps=8, num_stages=3]"
    )
    assert variant({"repr": "_k[num_warps=4](x: *bf16)"}) == "_k[num_warps=4](x: *bf16)"
    assert variant({}) == "?"


def test_kernel_name_falls_back_to_the_repr():
    assert kernel_name({"fn": _jit_info("_argmax_kernel")}) == "_argmax_kernel"
    assert kernel_name({"repr": "_embedding_kernel[num_warps=4](x: *bf16)"}) == "_embedding_kernel"
    assert kernel_name({}) == "?"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (a real Triton compile)")
def test_a_real_first_launch_is_caught():
    from kernels.backend import load_triton
    from kernels.skinny_gemm import skinny_gemm

    runtime = load_triton().knobs.runtime
    hooks = runtime.jit_cache_hook, runtime.jit_post_compile_hook
    try:
        watch = watch_late_compiles("test")
        assert watch is not None, "this Triton has no JIT hooks"
        x = torch.randn(3, 72, device="cuda", dtype=torch.float16)
        # A tile no other test uses, so that its variant is not in the kernel's cache yet.
        weight = torch.randn(40, 72, device="cuda", dtype=torch.float16)
        skinny_gemm(x, weight, None, 16, 16, 3, num_stages=5)
        torch.cuda.synchronize()
    finally:
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = hooks
    assert any(kernel == "_skinny_gemm_kernel" for kernel, _ in watch.compiles), watch.compiles
