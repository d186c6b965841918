"""Compiling Triton kernels ahead at a worker's start-up: a caught launch compiles and does
not run, the launch made again afterwards finds its kernel compiled, and a worker's start-up
compiles nothing one kernel at a time: the caught passes over the profile run and the graph
captures hold every variant the real ones launch. The mechanism itself is in
test_compile_ahead.py."""

from __future__ import annotations

import inspect
import sys

import pytest
import torch
from triton_test_util import CUDA, gen, randn
from worker_helpers import drive, engine_config, make_tiny_checkpoint

from kernels import compile_ahead
from kernels.argmax import argmax_rows_ref, argmax_rows_triton
from pegainfer.protocol import SamplingParams

needs_compile_ahead = pytest.mark.skipif(
    not (CUDA and compile_ahead.available()),
    reason="needs CUDA and a Triton with its asynchronous compile mode",
)


def _triton_kernels() -> list:
    from triton.runtime.jit import JITFunction

    found = []
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] != "kernels" or module is None:
            continue
        found += [v for v in vars(module).values() if isinstance(v, JITFunction)]
    return found


def _forget_compiled_kernels() -> None:
    """Empty every kernel's in-process cache, so that each variant goes through a compile
    again (served from Triton's disk cache, but still counted)."""
    for kernel in _triton_kernels():
        kernel.device_caches.clear()


@needs_compile_ahead
@pytest.mark.gpu
def test_a_caught_launch_compiles_and_does_not_run():
    import kernels.argmax

    _forget_compiled_kernels()
    logits = randn(3, 5000, g=gen(5), dtype=torch.float16)
    out = torch.full((3,), -7, dtype=torch.int64, device=logits.device)
    with compile_ahead.compile_ahead(threads=2) as report:
        argmax_rows_triton(logits, out=out)
    torch.cuda.synchronize()
    assert (report.launches, report.variants) == (1, 1)
    assert torch.equal(out, torch.full_like(out, -7)), "the caught launch ran"
    kernel_cache = kernels.argmax._argmax_kernel.device_caches[torch.cuda.current_device()][0]
    assert len(kernel_cache) == 1
    argmax_rows_triton(logits, out=out)
    assert len(kernel_cache) == 1, "the launch after the block compiled again"
    assert torch.equal(out, argmax_rows_ref(logits))


@needs_compile_ahead
@pytest.mark.gpu
def test_a_failed_pass_leaves_the_launch_after_it_working(monkeypatch):
    """A compile that fails inside the block fails the block; the same launch made after it
    compiles afresh and runs."""
    _forget_compiled_kernels()
    logits = randn(2, 3000, g=gen(6), dtype=torch.float16)

    def failing(compile_kernel, forked=False):
        raise RuntimeError("the compile failed")

    with monkeypatch.context() as patch:
        patch.setattr(compile_ahead, "_compile_with_launcher", failing)
        with pytest.raises(RuntimeError, match="the compile failed"):
            with compile_ahead.compile_ahead(threads=2):
                argmax_rows_triton(logits)
    assert torch.equal(argmax_rows_triton(logits), argmax_rows_ref(logits))


@needs_compile_ahead
@pytest.mark.gpu
def test_worker_start_up_compiles_nothing_one_at_a_time(tmp_path, monkeypatch, caplog):
    """Every compile during a worker's start-up happens inside a caught pass: the profile run
    and the graph captures launch only variants compiled ahead."""
    pytest.importorskip("transformers")
    from triton.runtime import _async_compile
    from triton.runtime.jit import JITFunction

    from worker_proc.model_runner import ModelRunner

    # Five layers, so that the pass's forwards run only the representative three of them.
    checkpoint = make_tiny_checkpoint(str(tmp_path), "qwen3", seed=41, num_hidden_layers=5)
    config = engine_config(
        checkpoint,
        dtype="bfloat16",
        block_size=16,
        kv_cache_memory=0,  # so that the profile run sizes the cache
        gpu_memory_utilization=0.2,
        max_num_seqs=12,
        max_num_batched_tokens=256,
    )
    config.device = "cuda"
    _forget_compiled_kernels()
    ahead, one_at_a_time = [], []
    original = JITFunction._do_compile

    def counting(self, *args, **kwargs):
        caught = _async_compile.active_mode.get() is not None
        (ahead if caught else one_at_a_time).append(self.fn.__name__)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(JITFunction, "_do_compile", counting)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))  # nothing noted yet
    caplog.set_level("INFO")
    runner = ModelRunner(config)
    assert runner.graphs is not None and runner.prefill_graphs is not None
    assert ahead, "nothing was compiled ahead"
    assert "profile run and graph capture: " in caplog.text  # one pass over both
    assert "profile run and graph capture: the last new variants found: " in caplog.text
    assert one_at_a_time == [], f"compiled during the real runs: {sorted(set(one_at_a_time))}"
    # Serving greedy and sampled requests launches nothing new either.
    requests = [
        (f"r{i}", [5 + i, 7, 11 + 3 * i], SamplingParams(temperature=0.8 * (i % 2), seed=i))
        for i in range(6)
    ]
    outputs, _, _ = drive(runner, requests, 2, num_kv_blocks=runner.num_kv_blocks)
    assert all(outputs[request_id] for request_id, _, _ in requests)
    assert one_at_a_time == [], f"compiled while serving: {sorted(set(one_at_a_time))}"
    del runner
    torch.cuda.empty_cache()

    # A second start-up, in a process that has compiled nothing yet, finds the pass noted and
    # does not run it: the captures load their kernels from Triton's disk cache, and so does
    # the start-up for the kernels no graph launches, so serving loads nothing.
    caplog.clear()
    _forget_compiled_kernels()
    runner = ModelRunner(config)
    assert runner.graphs is not None
    assert caplog.text.count("compiled ahead by an earlier start-up") == 1
    one_at_a_time.clear()
    outputs, _, _ = drive(runner, requests, 2, num_kv_blocks=runner.num_kv_blocks)
    assert all(outputs[request_id] for request_id, _, _ in requests)
    assert one_at_a_time == [], f"loaded while serving: {sorted(set(one_at_a_time))}"
    del runner
    torch.cuda.empty_cache()


@needs_compile_ahead
@pytest.mark.gpu
def test_eager_prefills_long_and_short_launch_only_variants_compiled_at_start_up(
    tmp_path, monkeypatch
):
    """With no profile run (a KV cache size given), the compile pass still launches the
    eager prefills' attention: a prompt past every prefill graph in the long tile, and one in
    the short tile, compile nothing while served."""
    pytest.importorskip("transformers")
    from triton.runtime import _async_compile
    from triton.runtime.jit import JITFunction

    from kernels import prefill_tiles
    from worker_proc.model_runner import ModelRunner

    checkpoint = make_tiny_checkpoint(str(tmp_path), "qwen3", seed=43, num_hidden_layers=3)
    tokens = 1600
    config = engine_config(
        checkpoint,
        dtype="bfloat16",
        block_size=16,
        kv_cache_memory=8 << 20,
        max_model_len=2048,
        max_num_seqs=4,
        max_num_batched_tokens=tokens,
    )
    config.device = "cuda"
    # Prompts of 1,500 tokens and more take the long tile; both run eagerly (past 1,280).
    monkeypatch.setenv("PEGAINFER_PREFILL_LONG_QUERIES", "1500")
    prefill_tiles.long_query_tokens.cache_clear()
    _forget_compiled_kernels()
    one_at_a_time = []
    original = JITFunction._do_compile

    def counting(self, *args, **kwargs):
        if _async_compile.active_mode.get() is None:
            one_at_a_time.append(self.fn.__name__)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(JITFunction, "_do_compile", counting)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    try:
        runner = ModelRunner(config)
        assert one_at_a_time == [], f"compiled at start-up: {sorted(set(one_at_a_time))}"
        for length in (1550, 1400):
            request = (f"p{length}", [3 + i % 50 for i in range(length)], SamplingParams())
            outputs, _, _ = drive(
                runner, [request], 1, num_kv_blocks=runner.num_kv_blocks,
                max_num_batched_tokens=tokens, max_model_len=2048, block_size=16,
            )  # fmt: skip
            assert outputs[request[0]], length
        assert one_at_a_time == [], f"compiled while serving: {sorted(set(one_at_a_time))}"
    finally:
        monkeypatch.delenv("PEGAINFER_PREFILL_LONG_QUERIES")
        prefill_tiles.long_query_tokens.cache_clear()
    del runner
    torch.cuda.empty_cache()


def test_eager_prefill_tiles_are_launched_once_each_for_the_captures(monkeypatch):
    """The eager prefills' attention tiles (long from LONG_QUERY_TOKENS on, short below) are
    each launched on one query tile, unsplit and split over keys, so that the compile pass
    compiles them and the real capture loads them."""
    import kernels
    from kernels import prefill_tiles
    from worker_proc.layers import attention

    launched, slacks = [], set()

    def record(q, *args, **kwargs):
        launched.append((q.shape[0], kwargs["block_m"], kwargs["block_n"], kwargs["num_splits"]))
        slacks.add((kwargs["block_m"], kwargs["rescale_slack"]))

    monkeypatch.setattr(kernels, "use_triton", lambda tensor: True)
    monkeypatch.setattr(attention, "paged_prefill_attention_triton", record)
    layer = attention.Attention(32, 128, 128**-0.5, 8, 0)
    cache = torch.zeros(4, 16, 8, 128, dtype=torch.bfloat16)
    layer.k_cache, layer.v_cache = cache, cache.clone()
    long, short = prefill_tiles.LONG_TILE, prefill_tiles.SHORT_TILE
    layer.launch_eager_prefills(8192)
    assert launched == [
        (16, short.block_m, short.block_n, 1),
        (16, short.block_m, short.block_n, 2),
        (32, long.block_m, long.block_n, 1),
        (32, long.block_m, long.block_n, 2),
    ]
    # Each tile as the steps launch it, the long one with its lazy rescale.
    assert slacks == {
        (short.block_m, short.rescale_slack),
        (long.block_m, long.rescale_slack),
    }
    assert long.rescale_slack > 0
    launched.clear()
    layer.launch_eager_prefills(1024)  # no step of this engine reaches the long tile
    assert launched == [(16, short.block_m, short.block_n, n) for n in (1, 2)]
    monkeypatch.setenv("PEGAINFER_PREFILL_LONG_QUERIES", "0")
    prefill_tiles.long_query_tokens.cache_clear()
    try:
        launched.clear()
        layer.launch_eager_prefills(8192)
        assert launched == [(16, short.block_m, short.block_n, n) for n in (1, 2)]
    finally:
        monkeypatch.delenv("PEGAINFER_PREFILL_LONG_QUERIES")
        prefill_tiles.long_query_tokens.cache_clear()


def test_the_start_up_compiles_once_with_the_profile_or_else_alone(monkeypatch):
    from pegainfer.startup_timeline import StartupTimeline
    from worker_proc import graph_capture

    calls = []
    monkeypatch.setattr(
        graph_capture, "compile_graph_kernels", lambda *args: calls.append(args[-2:]) or None
    )
    timeline = StartupTimeline(first_phase=None)
    with_profile = graph_capture.KernelCompile(("model", "config"), timeline)
    assert not with_profile.with_profile("profile run", ("settings",))
    with_profile.graphs_alone()  # already done with the profile run
    alone = graph_capture.KernelCompile(("model", "config"), timeline)
    alone.graphs_alone()
    assert calls == [("profile run", ("settings",)), ("model", "config")]
    assert [phase for phase, _ in timeline.phases] == ["kernel compile", "kernel compile"]


def test_the_compile_only_pass_runs_each_capture_once_and_keeps_no_graph(tmp_path, caplog):
    pytest.importorskip("transformers")
    from worker_proc.cuda_graphs import capture_sizes
    from worker_proc.graph_capture import CompileOnlyBackend, capture_graphs
    from worker_proc.model_runner import ModelRunner
    from worker_proc.prefill_graphs import prefill_token_sizes

    checkpoint = make_tiny_checkpoint(str(tmp_path), "qwen3", seed=42)
    config = engine_config(checkpoint, max_num_seqs=4, max_num_batched_tokens=128)
    runner = ModelRunner(config)

    class Counting(CompileOnlyBackend):
        runs = 0

        def capture(self, fn):
            Counting.runs += 1
            return super().capture(fn)

    def capture(backend):
        return capture_graphs(
            runner.model,
            config,
            runner.model_config.vocab_size,
            runner.max_blocks_per_seq,
            runner.dtype,
            runner.device,
            backend,
        )

    caplog.set_level("INFO")
    captured = capture(Counting())
    expected = len(capture_sizes(4)) + len(prefill_token_sizes(128))
    assert Counting.runs == expected > 0
    assert "captured" not in caplog.text
    with pytest.raises(RuntimeError, match="nothing to replay"):
        captured.decode.replay(1)

    class Failing(CompileOnlyBackend):
        def capture(self, fn):
            raise ValueError("a kernel failed to compile")

    # A failure inside the caught pass propagates (compile_for logs it once), rather than
    # being reported as a failed capture.
    with pytest.raises(ValueError, match="failed to compile"):
        capture(Failing())


def test_with_several_ranks_every_start_up_runs_its_pass(monkeypatch):
    import worker_proc.graph_capture as graph_capture

    model = torch.nn.Linear(8, 4)
    assert graph_capture.compile_ahead_key("graphs", model, 12) is not None
    monkeypatch.setattr(graph_capture, "get_tp_size", lambda: 2)
    assert graph_capture.compile_ahead_key("graphs", model, 12) is None


def test_the_pass_runs_the_first_second_and_last_layers_and_puts_them_back(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from worker_proc.graph_capture import compile_layers
    from worker_proc.model_runner import ModelRunner

    checkpoint = make_tiny_checkpoint(str(tmp_path), "qwen3", seed=43, num_hidden_layers=5)
    runner = ModelRunner(engine_config(checkpoint, max_num_seqs=4, max_num_batched_tokens=64))
    layers = list(runner.model.model.layers)
    ran = []
    for index, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda module, args, index=index: ran.append(index))
    names = [name for name, _ in runner.model.named_parameters()]
    full = runner.prefill_logits([3, 5, 7])
    assert ran == [0, 1, 2, 3, 4]

    ran.clear()
    with compile_layers(runner.model):
        runner.prefill_logits([3, 5, 7])
    assert ran == [0, 1, 4]
    assert list(runner.model.model.layers) == layers
    assert [name for name, _ in runner.model.named_parameters()] == names
    ran.clear()
    torch.testing.assert_close(runner.prefill_logits([3, 5, 7]), full, rtol=0, atol=0)
    assert ran == [0, 1, 2, 3, 4]

    ran.clear()
    monkeypatch.setenv("PEGAINFER_COMPILE_LAYERS", "all")
    with compile_layers(runner.model):
        runner.prefill_logits([3, 5, 7])
    assert ran == [0, 1, 2, 3, 4]
    with compile_layers(torch.nn.Linear(4, 4)):  # a model that names no representative layers
        pass


@pytest.mark.skipif(not compile_ahead.available(), reason="needs Triton's asynchronous mode")
def test_the_report_times_the_caught_run_and_its_last_new_variant(monkeypatch):
    import time

    from triton.runtime._async_compile import active_mode

    monkeypatch.setenv("PEGAINFER_COMPILE_FORK", "0")
    with compile_ahead.compile_ahead(threads=2) as report:
        time.sleep(0.05)
        mode = active_mode.get()
        hooks = [lambda kernel: None]
        if "cleanup_fn" in inspect.signature(mode.submit).parameters:  # newer Triton
            hooks.append(lambda future_kernel: None)
        mode.submit("a kernel", lambda: time.sleep(0.1), *hooks)
    assert 0.05 <= report.last_found <= report.run_seconds < report.seconds
    assert report.seconds >= report.last_found + 0.1
