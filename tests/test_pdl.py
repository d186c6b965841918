"""Programmatic dependent launch (kernels/pdl.py).

With PDL a kernel's programs start before their predecessor ends, so a wrong read before
the wait would show as a result that differs from the same chain run in strict stream order.
The GPU tests run chains of dependent kernels, eagerly and in a CUDA graph, with PDL on
and off, and require bit-identical outputs; they skip without a Hopper-class GPU. On the
CPU the switch itself is tested.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from kernels import backend, pdl

needs_hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="needs a CUDA GPU of compute capability 9.0 or later",
)


@pytest.fixture
def pdl_switch(monkeypatch) -> Iterator[Callable[[bool], None]]:
    def switch(on: bool) -> None:
        monkeypatch.setenv("PEGAINFER_PDL", "1" if on else "0")
        backend._pdl_supported.cache_clear()

    yield switch
    backend._pdl_supported.cache_clear()


def test_never_on_cpu_tensors():
    assert not backend.use_pdl(torch.zeros(1))


def test_off_in_the_interpreter_and_by_env(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    backend._pdl_supported.cache_clear()
    assert not backend._pdl_supported(0)
    monkeypatch.delenv("TRITON_INTERPRET")
    for off in ("0", "false", "off"):
        monkeypatch.setenv("PEGAINFER_PDL", off)
        backend._pdl_supported.cache_clear()
        assert not backend._pdl_supported(0)
    backend._pdl_supported.cache_clear()


def test_launch_options_only_name_pdl_when_used():
    assert pdl.launch_options(False) == {}
    assert pdl.launch_options(True) == {"launch_pdl": True}


def _mlp_chain(x: torch.Tensor, weights: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
    """Decoder-layer-shaped chain at one row: each kernel reads what the one before wrote."""
    from kernels.activation import silu_and_mul
    from kernels.linear import linear
    from kernels.rmsnorm import fused_add_rms_norm, rms_norm

    residual = x
    hidden = rms_norm(x, weights[0][0], 1e-6)
    for norm_weight, up_weight, down_weight in weights:
        hidden = silu_and_mul(linear(hidden, up_weight))
        hidden = linear(hidden, down_weight)
        hidden, residual = fused_add_rms_norm(hidden, residual, norm_weight, 1e-6)
    return hidden


def _chain_weights(hidden: int, intermediate: int, layers: int, device: str):
    g = torch.Generator(device=device).manual_seed(7)
    dtype = torch.bfloat16

    def randn(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    return [
        (
            1.0 + randn(hidden, scale=0.1),
            randn(2 * intermediate, hidden, scale=hidden**-0.5),
            randn(hidden, intermediate, scale=intermediate**-0.5),
        )
        for _ in range(layers)
    ]


def _run(fn: Callable[[], torch.Tensor], graph: bool) -> torch.Tensor:
    if not graph:
        out = fn()
        torch.cuda.synchronize()
        return out.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compiles and warms up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    cuda_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cuda_graph):
        out = fn()
    results = []
    for _ in range(3):
        cuda_graph.replay()
        torch.cuda.synchronize()
        results.append(out.clone())
    assert all(torch.equal(r, results[0]) for r in results)
    return results[0]


@needs_hopper
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("rows", [1, 2])
def test_layer_chain_same_with_and_without_pdl(pdl_switch, graph, rows):
    weights = _chain_weights(2048, 4096, layers=12, device="cuda")
    x = torch.randn(rows, 2048, device="cuda").to(torch.bfloat16)
    outputs = {}
    for on in (False, True):
        pdl_switch(on)
        outputs[on] = _run(lambda: _mlp_chain(x, weights), graph)
    assert torch.isfinite(outputs[True].float()).all()
    assert torch.equal(outputs[True], outputs[False])


@needs_hopper
@pytest.mark.parametrize("rows", [1, 2, 8])
def test_layer_chain_same_whichever_kernels_launch_late(monkeypatch, rows):
    """Letting the successor launch only at the end is the conservative order: any choice of
    late launchers gives the same bits as the default."""
    weights = _chain_weights(2048, 4096, layers=12, device="cuda")
    x = torch.randn(rows, 2048, device="cuda").to(torch.bfloat16)
    outputs = []
    for setting in (None, "none", ",".join(pdl.LAUNCHING_KERNELS)):
        if setting is None:
            monkeypatch.delenv("PEGAINFER_LATE_LAUNCH", raising=False)
        else:
            monkeypatch.setenv("PEGAINFER_LATE_LAUNCH", setting)
        outputs.append(_run(lambda: _mlp_chain(x, weights), graph=True))
    assert torch.isfinite(outputs[0].float()).all()
    assert all(torch.equal(out, outputs[0]) for out in outputs[1:])


def test_late_launchers_default_list_and_errors(monkeypatch):
    monkeypatch.delenv("PEGAINFER_LATE_LAUNCH", raising=False)
    assert not pdl.launches_successor_early("rows_gemv_add")
    assert pdl.launches_successor_early("skinny") and pdl.launches_successor_early("gemv_add")
    assert pdl.launches_successor_early("skinny_add")
    assert pdl.launches_successor_early("rows_gemv")
    monkeypatch.setenv("PEGAINFER_LATE_LAUNCH", "none")
    assert all(pdl.launches_successor_early(name) for name in pdl.LAUNCHING_KERNELS)
    monkeypatch.setenv("PEGAINFER_LATE_LAUNCH", " Decode_Attention, rotary ")
    late = [name for name in pdl.LAUNCHING_KERNELS if not pdl.launches_successor_early(name)]
    assert late == ["decode_attention", "rotary"]
    monkeypatch.setenv("PEGAINFER_LATE_LAUNCH", "rotary,attention")
    with pytest.raises(ValueError, match="PEGAINFER_LATE_LAUNCH names attention"):
        pdl.launches_successor_early("rotary")
    with pytest.raises(ValueError, match="unknown kernel"):
        pdl.launches_successor_early("gemm")


def test_every_launch_names_a_known_kernel():
    """The names reach ``launches_successor_early`` only on a GPU with PDL: checked here."""
    import re
    from pathlib import Path

    sources = Path(pdl.__file__).parent.glob("*.py")
    calls = [
        call
        for source in sources
        for call in re.findall(r"launch_successor\(\s*with_pdl,(.*?)\)", source.read_text(), re.S)
    ]
    names = {name for call in calls for name in re.findall(r'"(\w+)"', call)}
    assert len(calls) == 17 and names == set(pdl.LAUNCHING_KERNELS)


def _attention_chain(state: dict[str, torch.Tensor], steps: int) -> torch.Tensor:
    """Rotary writes this step's key and value into the paged cache, decode attention reads
    them (and its block table) right after, a linear layer reads the attention's output.
    Each step's positions and context lengths are made first, as a decode step's inputs are,
    so that attention directly follows rotary."""
    from kernels.attention import paged_attention
    from kernels.linear import linear
    from kernels.rotary import rotary_and_store_kv

    q_all, kv_all, outs = state["q"], state["kv"], []
    num_heads, head_dim = q_all.shape[-2:]
    positions = [state["positions"] + step for step in range(steps)]
    context_lens = [state["context_lens"] + step for step in range(steps)]
    queries = [q_all[step].clone() for step in range(steps)]
    for step in range(steps):
        q = rotary_and_store_kv(
            positions[step],
            queries[step],
            kv_all[step, :, 0],
            kv_all[step, :, 1],
            state["cos"],
            state["sin"],
            state["k_cache"],
            state["v_cache"],
            state["slots"][step],
        )
        attn = paged_attention(
            q,
            state["k_cache"],
            state["v_cache"],
            state["block_tables"],
            context_lens[step],
            state["query_start_loc"],
            head_dim**-0.5,
            max_query_len=1,
            max_context_len=state["block_tables"].shape[1] * state["k_cache"].shape[1],
        )
        outs.append(linear(attn.reshape(attn.shape[0], num_heads * head_dim), state["o_weight"]))
    return torch.stack(outs)


@needs_hopper
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
# The newest token in the first tile of a one-split context, of the last of many one-tile
# splits, and in the second tile of a 128-token split.
@pytest.mark.parametrize("context", [5, 700, 3179])
def test_attention_chain_same_with_and_without_pdl(pdl_switch, graph, context):
    g = torch.Generator(device="cuda").manual_seed(context)
    dtype, device = torch.bfloat16, "cuda"
    num_heads, num_kv_heads, head_dim, block_size, steps = 32, 8, 128, 16, 6
    num_blocks = 4 * (context + steps) // block_size + 8
    blocks_per_seq = (context + steps + block_size - 1) // block_size
    table = torch.randperm(num_blocks, generator=g, device=device)[:blocks_per_seq]
    positions = torch.tensor([context], device=device)
    slots = torch.stack(
        [
            table[(context + s) // block_size] * block_size + (context + s) % block_size
            for s in range(steps)
        ]
    ).view(steps, 1)
    angles = torch.outer(torch.arange(4096.0, device=device), torch.rand(64, device=device))

    def fresh_state() -> dict[str, torch.Tensor]:
        cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
        g.manual_seed(context + 1)
        return {
            "q": torch.randn(steps, 1, num_heads, head_dim, generator=g, device=device).to(dtype),
            "kv": torch.randn(steps, 1, 2, num_kv_heads, head_dim, generator=g, device=device).to(
                dtype
            ),
            "k_cache": torch.randn(cache_shape, generator=g, device=device).to(dtype),
            "v_cache": torch.randn(cache_shape, generator=g, device=device).to(dtype),
            "o_weight": (
                torch.randn(2560, num_heads * head_dim, generator=g, device=device) * 0.02
            ).to(dtype),
            "cos": angles.cos().to(dtype),
            "sin": angles.sin().to(dtype),
            "positions": positions,
            "slots": slots,
            "block_tables": table[None, :].int(),
            "context_lens": torch.tensor([context + 1], device=device, dtype=torch.int32),
            "query_start_loc": torch.tensor([0, 1], device=device, dtype=torch.int32),
        }

    outputs = {}
    for on in (False, True):
        pdl_switch(on)
        state = fresh_state()
        outputs[on] = (_run(lambda s=state: _attention_chain(s, steps), graph), state["k_cache"])
    assert torch.isfinite(outputs[True][0].float()).all()
    assert torch.equal(outputs[True][0], outputs[False][0])
