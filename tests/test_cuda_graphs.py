"""CUDA-graph decode. On the CPU, ``EagerGraphBackend`` stands in for CUDA graphs (a replay
re-runs the captured function over the same static buffers), which tests bucket choice,
padding and static-buffer filling; the GPU tests compare real graphs with eager runs."""

from __future__ import annotations

import pytest
import torch
from worker_helpers import drive, engine_config, greedy_reference, make_tiny_checkpoint

from pegainfer.protocol import BlockTableUpdate, NewSequence, SamplingParams, StepPlan, pack_ids
from worker_proc.batch import SequenceState, TokensNotOnHost, layout_step
from worker_proc.cuda_graphs import EagerGraphBackend, capture_sizes, pick_size
from worker_proc.model_runner import ModelRunner
from worker_proc.prefill_graphs import PrefillGraphs

pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0.0)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("qwen3")), "qwen3", seed=33)


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("qwen3-moe")), "qwen3_moe", seed=34)


@pytest.fixture(scope="module")
def graph_runner(checkpoint) -> tuple[ModelRunner, EagerGraphBackend]:
    backend = EagerGraphBackend()
    runner = ModelRunner(engine_config(checkpoint, max_num_seqs=12), graph_backend=backend)
    return runner, backend


def _requests(count: int = 7) -> list[tuple[str, list[int], SamplingParams]]:
    requests = []
    for i in range(count):
        prompt = [(37 * i + 11 * j) % 500 + 1 for j in range(1 + (5 * i) % 9)]
        sampling = (
            SamplingParams(temperature=0.8, top_k=40, seed=i, max_tokens=6 + i)
            if i % 3 == 2
            else SamplingParams(temperature=0.0, max_tokens=6 + 2 * i)
        )
        requests.append((f"r{i}", prompt, sampling))
    return requests


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    sizes = capture_sizes(256)
    assert sizes[:11] == capture_sizes(64) and sizes[11:13] == [80, 96] and sizes[-1] == 256
    assert all(b - a == 16 for a, b in zip(sizes[10:], sizes[11:]))
    assert capture_sizes(100)[-2:] == [96, 100]
    assert capture_sizes(512)[len(sizes) :] == list(range(288, 513, 32))
    with pytest.raises(ValueError):
        capture_sizes(0)
    assert [pick_size(n, sizes) for n in (1, 3, 8, 9, 65, 256)] == [1, 4, 8, 16, 80, 256]
    assert pick_size(257, sizes) is None


@pytest.mark.parametrize("writes_out", [False, True], ids=["copied", "written"])
def test_decode_graphs_take_the_argmax_of_their_logits(writes_out):
    """Each replay leaves its rows' argmax beside the logits, for the sampler's greedy rows,
    whether the forward wrote the shared logits buffer itself or returned logits of its own."""
    from worker_proc.cuda_graphs import DecodeGraphs

    graphs = DecodeGraphs([1, 4], 4, 64, 50, torch.float32, torch.device("cpu"))
    table = torch.randn(500, 50)

    def forward_logits(
        input_ids: torch.Tensor, positions: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        logits = table[input_ids + positions]
        return out.copy_(logits) if writes_out else logits

    graphs.capture(forward_logits, EagerGraphBackend())
    for size, ids in ((4, [3, 99, 7, 250]), (1, [41])):
        graphs.input_ids[:size] = torch.tensor(ids)
        graphs.positions[:size] = torch.arange(size)
        logits = graphs.replay(size)
        assert torch.equal(logits, table[graphs.input_ids[:size] + graphs.positions[:size]])
        assert torch.equal(graphs.greedy_tokens[:size], logits.argmax(dim=-1))


def test_capture_order_real_largest_first_compile_only_smallest_first(monkeypatch):
    """Real captures go largest first (one warm-up's cached blocks serve the next); a
    compile-only pass goes smallest first and runs the input loader before any size, so that
    the kernels only small batches launch are met (and start compiling) early."""
    from worker_proc.cuda_graphs import DecodeGraphs
    from worker_proc.graph_capture import CompileOnlyBackend

    events: list[object] = []
    monkeypatch.setattr(DecodeGraphs, "_compile_loader", lambda self: events.append("loader"))

    def forward_logits(input_ids, positions, out):
        events.append(len(input_ids))
        return out

    for backend, expected in (
        (EagerGraphBackend(), [8, 4, 2, 1, "loader"]),
        (CompileOnlyBackend(), ["loader", 1, 2, 4, 8]),
    ):
        events.clear()
        graphs = DecodeGraphs([1, 2, 4, 8], 4, 64, 50, torch.float32, torch.device("cpu"))
        graphs.capture(forward_logits, backend)
        assert events == expected


def test_prefill_graph_for_a_batch_has_room_for_its_sequences():
    """Graphs from 512 tokens hold every sequence of a mixed step (up to ``max_seqs``);
    smaller ones hold four, so few tokens in many sequences go up to the 512-token graph."""
    graphs = PrefillGraphs([32, 64, 512, 640], 12, 4, 64, 16, torch.float32, torch.device("cpu"))
    graphs._replays = dict.fromkeys(graphs.token_sizes, lambda: None)
    assert [graphs.context(size).num_seqs for size in (32, 64, 512, 640)] == [4, 4, 12, 12]
    assert graphs.context(64).query_start_loc.shape == (5,)
    assert graphs.size_for(3, 20) == 32
    assert graphs.size_for(4, 64) == 64
    assert graphs.size_for(5, 20) == 512  # thirteen decodes and a short chunk, say
    assert graphs.size_for(12, 600) == 640
    assert graphs.size_for(13, 20) is None
    assert graphs.size_for(1, 641) is None


def test_layout_pads_to_the_graph_size():
    seqs = [
        SequenceState(1, [5, 6, 7], 3, GREEDY, block_table=[4], slot=0),
        SequenceState(2, [8, 9], 2, GREEDY, block_table=[2], slot=3, num_tokens=3),
    ]
    layout = layout_step(seqs, [2, 2], [1, 1], block_size=4, num_rows=4, scratch_slot=9)
    assert layout.num_seqs == 2 and layout.num_rows == 4 and layout.num_tokens == 4
    assert layout.input_ids.tolist() == [7, 0, 0, 0]  # row 1's token is still on the device
    assert layout.pending_index.tolist() == [1] and layout.pending_slot.tolist() == [3]
    assert layout.positions.tolist() == [2, 2, 0, 0]
    assert layout.slot_mapping.tolist() == [18, 10, -1, -1]  # padding writes nothing
    assert layout.row_slots.tolist() == [0, 3, 9, 9]
    assert layout.context_lens.tolist() == [3, 3, 1, 1]
    assert layout.query_lens.tolist() == [1, 1, 1, 1]
    assert layout.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert layout.sample_rows == [0, 1] and layout.sample_index.tolist() == [0, 1]
    assert layout.sample_pos.tolist() == [3, 3] and layout.sample_slot.tolist() == [0, 3]
    with pytest.raises(ValueError):
        layout_step(seqs, [2, 2], [1, 1], block_size=4, num_rows=1)


def test_decode_layout_fast_path_equals_the_general_one():
    import numpy as np

    from worker_proc.batch import UPLOAD_ORDER, _layout_general

    seqs = [
        SequenceState(1, list(range(10)), 10, GREEDY, block_table=[7, 3, 9], slot=2),
        SequenceState(2, [4, 5], 2, GREEDY, block_table=[1], slot=0, num_tokens=3),  # pending
        SequenceState(3, list(range(8)), 8, GREEDY, block_table=[5, 6], slot=5),  # mid-prompt
        SequenceState(4, [1, 2, 3, 4, 5], 5, GREEDY, block_table=[8, 2], slot=1),
    ]
    computed = [9, 2, 3, 4]
    for rows in (4, 8):
        fast = layout_step(seqs, computed, [1] * 4, 4, rows, scratch_slot=11)
        slow = _layout_general(seqs, computed, [1] * 4, 4, rows, 11)
        assert fast.sample_rows == slow.sample_rows == [0, 1, 3]
        for name in UPLOAD_ORDER:
            assert np.array_equal(getattr(fast, name), getattr(slow, name)), name
            assert getattr(fast, name).dtype == getattr(slow, name).dtype, name
        assert (fast.max_context_len, fast.max_blocks) == (slow.max_context_len, slow.max_blocks)
    stale = SequenceState(5, [1, 2], 2, GREEDY, block_table=[4], slot=3, num_tokens=4)
    with pytest.raises(TokensNotOnHost):
        layout_step([stale], [2], [1], 4)  # token 2 is on the device, but not the newest


def test_graph_decode_matches_eager(graph_runner, checkpoint):
    runner, backend = graph_runner
    assert runner.graphs is not None and runner.graphs.sizes == [1, 2, 4, 8, 12]
    assert runner.prefill_graphs is not None
    prefill_sizes = runner.prefill_graphs.token_sizes
    assert prefill_sizes and prefill_sizes == sorted(prefill_sizes)
    assert backend.num_captures == 5 + len(prefill_sizes)
    eager = ModelRunner(engine_config(checkpoint, max_num_seqs=12))
    assert eager.graphs is None  # the CPU default: no graphs
    requests = _requests()
    for in_flight in (1, 2):
        before = backend.num_replays
        got, finish, _ = drive(runner, requests, in_flight, max_num_seqs=12)
        assert backend.num_replays - before > 10  # the decode steps ran from "graphs"
        want, want_finish, _ = drive(eager, requests, in_flight, max_num_seqs=12)
        assert got == want and finish == want_finish
    assert got["r0"] == greedy_reference(eager, requests[0][1], requests[0][2].max_tokens)


def test_padding_rows_write_no_kv(graph_runner):
    """Three decodes padded to four rows: the KV cache changes at the three real slots
    only (the scratch row points at block 0, which a real sequence owns here)."""
    runner, backend = graph_runner
    new = [NewSequence(i, pack_ids([i + 1, i + 2, i + 3]), GREEDY, 3) for i in range(3)]
    updates = [BlockTableUpdate(i, pack_ids([i])) for i in range(3)]
    prefill = StepPlan(
        0, new, pack_ids([0, 1, 2]), pack_ids([0] * 3), pack_ids([3] * 3), updates, b""
    )

    def written_slots(before: torch.Tensor) -> list[list[int]]:
        # Bitwise: the CPU cache is uninitialised, and NaN != NaN.
        changed = runner.kv_storage.view(torch.int32) != before.view(torch.int32)
        changed = changed.flatten(4).any(-1)  # [layers, k/v, blocks, offset]
        return changed.nonzero()[:, 2:].unique(dim=0).tolist()

    replays = backend.num_replays
    runner.kv_storage.fill_(float("nan"))  # earlier tests may have left these very values
    before = runner.kv_storage.clone()
    runner.execute(prefill)
    # Nine tokens in three sequences, padded to the smallest prefill graph: the padding
    # tokens write nothing.
    assert backend.num_replays == replays + 1
    assert written_slots(before) == [[b, o] for b in range(3) for o in range(3)]
    before = runner.kv_storage.clone()
    decode = StepPlan(1, [], pack_ids([0, 1, 2]), pack_ids([3] * 3), pack_ids([1] * 3), [], b"")
    runner.execute(decode)
    assert backend.num_replays == replays + 2
    assert written_slots(before) == [[0, 3], [1, 3], [2, 3]]
    runner.execute(StepPlan(2, [], b"", b"", b"", [], pack_ids([0, 1, 2])))


def test_capture_failure_falls_back_to_eager(checkpoint, caplog):
    class Failing:
        def capture(self, fn):
            raise RuntimeError("operation not permitted when stream is capturing")

    runner = ModelRunner(engine_config(checkpoint, max_num_seqs=4), graph_backend=Failing())
    assert runner.graphs is None and "capture failed" in caplog.text
    outputs, _, _ = drive(runner, _requests(3), 2, max_num_seqs=4)
    assert len(outputs["r1"]) == 8


# --------------------------------------------------------------------------- on a GPU


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("model", ["checkpoint", "moe_checkpoint"])
@pytest.mark.parametrize("in_flight", [1, 2])
def test_cuda_graphs_give_the_same_greedy_tokens(model, in_flight, request):
    """Real CUDA graphs against eager, float32: a mix of concurrent greedy and seeded
    requests with chunked prefill, two steps in flight, padding to graph sizes. The mixture
    of experts routes and groups its tokens on the device inside the graphs."""
    checkpoint = request.getfixturevalue(model)
    outputs = []
    for eager in (False, True):
        config = engine_config(
            checkpoint, max_num_seqs=12, kv_cache_memory=64 << 20, enforce_eager=eager
        )
        config.device = "cuda"
        runner = ModelRunner(config)
        assert (runner.graphs is None) == eager
        outputs.append(drive(runner, _requests(11), in_flight, max_num_seqs=12)[:2])
        del runner
        torch.cuda.empty_cache()
    assert outputs[0] == outputs[1]


SAMPLINGS = [
    {"temperature": 0.0},
    {"temperature": 1.0},
    {"temperature": 0.6, "top_p": 0.95, "top_k": 20},
    {"temperature": 0.8, "top_k": 40},
    {"temperature": 0.7, "top_k": 20, "min_p": 0.05, "seed": 3},
    {"temperature": 0.7, "top_k": 20, "top_p": 0.9, "min_p": 0.05},
    {"temperature": 1.0, "top_p": 0.9},
    {"temperature": 0.0, "presence_penalty": 1.0},
    {"temperature": 0.0, "logit_bias_ids": [7, 11], "logit_bias_values": [-100.0, 3.0]},
    {"temperature": 0.8, "top_k": 20, "min_tokens": 5, "stop_token_ids": [3]},
]


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("model", ["checkpoint", "moe_checkpoint"])
def test_serving_compiles_no_triton_kernel_after_start_up(model, monkeypatch, request):
    """Decode batches of every size to 20 and contexts past 16 and 32 blocks, prefill chunks
    of every length, and every way of sampling (greedy, temperature alone, top-k with and
    without top-p and min-p, top-p alone, a penalty, a seed, a logit bias, a min_tokens
    mask): each Triton variant they launch
    was compiled at start-up. One compiled later stalls the step that launched it
    (kernels/compile_watch.py)."""
    from kernels import compile_watch
    from kernels.backend import load_triton

    checkpoint = request.getfixturevalue(model)
    config = engine_config(checkpoint, max_num_seqs=20, kv_cache_memory=64 << 20)
    config.device = "cuda"
    runner = ModelRunner(config)
    runtime = load_triton().knobs.runtime
    hooks = runtime.jit_cache_hook, runtime.jit_post_compile_hook
    monkeypatch.setattr(compile_watch, "_watch", None)
    requests = [
        (
            f"r{i}",
            [(13 * i + 7 * j) % 500 + 1 for j in range(30 + 3 * i)],
            SamplingParams(**SAMPLINGS[i % len(SAMPLINGS)], max_tokens=10 + (7 * i) % 30),
        )
        for i in range(20)
    ]
    try:
        watch = compile_watch.watch_late_compiles("test")
        assert watch is not None
        drive(runner, requests, 2, max_num_seqs=20)
    finally:
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = hooks
        del runner
        torch.cuda.empty_cache()
    assert watch.compiles == [], watch.summary()


@needs_cuda
@pytest.mark.gpu
def test_cuda_graphs_bfloat16_agree_with_eager(checkpoint):
    """bf16: graphs and eager differ only by rounding (padded GEMM shapes, split-KV
    attention), so tokens agree up to near-ties; the first token (an eager prefill in both)
    agrees exactly. The runner's token budget is the scheduler's (24), so no prefill graph
    (32 tokens and up) is captured: a prefill graph pads a step of five or more short
    prompts to 512 rows, where cuBLAS and the norm kernel run instead of the skinny GEMMs
    with the norm pending, whose roundings differ (kernels/pending_norm.py)."""
    outputs = []
    for eager in (False, True):
        config = engine_config(
            checkpoint,
            dtype="bfloat16",
            max_num_seqs=12,
            max_num_batched_tokens=24,
            kv_cache_memory=64 << 20,
            enforce_eager=eager,
        )
        config.device = "cuda"
        runner = ModelRunner(config)
        assert (runner.graphs is None) == eager
        if not eager:
            assert runner.graph_capture_seconds > 0
        outputs.append(drive(runner, _requests(11), 2, max_num_seqs=12)[0])
        del runner
        torch.cuda.empty_cache()
    graphs, eager = outputs
    matched = total = 0
    for request_id, tokens in eager.items():
        assert graphs[request_id][0] == tokens[0]
        prefix = next(
            (i for i, (a, b) in enumerate(zip(graphs[request_id], tokens)) if a != b),
            len(tokens),
        )
        matched, total = matched + prefix, total + len(tokens)
    print(f"bf16 graphs vs eager: {matched}/{total} tokens on the common prefix")
    assert matched >= 0.8 * total
