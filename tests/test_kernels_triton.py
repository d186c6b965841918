"""Triton kernels against their PyTorch references: RMSNorm (plain and fused with the
residual add), SiLU-and-multiply, rotary embedding (plain and fused with the KV-cache
write), the KV-cache write, and the dispatch rules. Attention is in
test_kernels_decode_attention.py and test_kernels_triton_attention.py (prefill); interpreter
setup and poisoning in triton_test_util.py.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from triton_test_util import (
    CUDA,
    DEVICE,
    SEED,
    assert_same_cache,
    check,
    gen,
    nan_cache,
    poisoned,
    randn,
    rel_err,
    requires_triton,
)

from kernels.activation import silu_and_mul_ref, silu_and_mul_triton
from kernels.attention import store_kv_ref, store_kv_triton
from kernels.backend import use_triton
from kernels.rmsnorm import (
    fused_add_rms_norm_ref,
    fused_add_rms_norm_triton,
    rms_norm_ref,
    rms_norm_triton,
)
from kernels.rotary import (
    rotary_and_store_kv_ref,
    rotary_and_store_kv_triton,
    rotary_embedding_ref,
    rotary_embedding_triton,
)

pytestmark = requires_triton

# --------------------------------------------------------------------------- elementwise

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(5, 96), (3, 200)] + ([(64, 2560)] if CUDA else []))
def test_rms_norm(dtype, rows, hidden):
    g = gen(1)
    x = randn(rows, hidden, g=g, dtype=dtype, scale=3.0)
    weight = randn(hidden, g=g, dtype=dtype)
    with poisoned():
        out = rms_norm_triton(x, weight, 1e-6)
    check(out, rms_norm_ref(x, weight, 1e-6), "rms_norm")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_per_head_on_strided_qkv_slice(dtype):
    """Qwen3's q/k norm: [T, heads, head_dim] views into the fused qkv output."""
    g = gen(2)
    tokens, heads, kv_heads, head_dim = 7, 4, 2, 32
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, g=g, dtype=dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    weight = randn(head_dim, g=g, dtype=dtype)
    with poisoned():
        out = rms_norm_triton(q, weight, 1e-6)
    check(out, rms_norm_ref(q, weight, 1e-6), "per-head rms_norm")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(6, 160)] + ([(256, 2560)] if CUDA else []))
def test_fused_add_rms_norm(dtype, rows, hidden):
    g = gen(3)
    x = randn(rows, hidden, g=g, dtype=dtype)
    residual = randn(rows, hidden, g=g, dtype=dtype, scale=4.0)
    weight = randn(hidden, g=g, dtype=dtype)
    x_before, residual_before = x.clone(), residual.clone()
    with poisoned():
        out, new_residual = fused_add_rms_norm_triton(x, residual, weight, 1e-5)
    ref_out, ref_residual = fused_add_rms_norm_ref(x_before, residual_before, weight, 1e-5)
    check(new_residual, ref_residual, "residual")
    check(out, ref_out, "normed")
    torch.testing.assert_close(x, x_before, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape", [(4, 2 * 72), (2, 3, 2 * 1100)] + ([(64, 2 * 9728)] if CUDA else [])
)
def test_silu_and_mul(dtype, shape):
    x = randn(*shape, g=gen(4), dtype=dtype, scale=3.0)
    with poisoned():
        out = silu_and_mul_triton(x)
    check(out, silu_and_mul_ref(x), "silu_and_mul")


@pytest.mark.filterwarnings("ignore:overflow encountered")  # numpy, in the interpreter
def test_row_counts_compile_no_new_variant():
    """An eager step's token count is any number: a specialized row count compiled a new
    variant of the norm and the activation inside the first such step (150-170 ms on an
    H200, named by the late-compile watch)."""
    from kernels import activation, rmsnorm

    for kernel in (rmsnorm._rms_norm_kernel, activation._silu_and_mul_kernel):
        fn = getattr(kernel, "fn", kernel)  # the Python function, before or after binding
        assert "num_rows" in fn.__pegainfer_do_not_specialize__


def test_norm_launches_of_any_row_count_share_a_variant(monkeypatch):
    """Every integer the norm kernel takes, not only ``num_rows``, specializes the same way
    whatever a step's row count (the embedding table's rows where it gathers, 0 where it
    does not): Triton keys a variant on an integer being 1 or a multiple of 16."""
    import inspect

    from kernels import rmsnorm
    from kernels.backend import load_triton

    load_triton()
    kernel = rmsnorm._rms_norm_kernel
    names = list(inspect.signature(getattr(kernel, "fn", kernel)).parameters)
    free = set(names) - set(getattr(kernel, "fn", kernel).__pegainfer_do_not_specialize__)
    keys: dict[int, list] = {}

    class Catch:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                bound = dict(zip(names, args), **kwargs)
                keys[rows].append(
                    sorted(
                        (name, value == 1, value % 16 == 0)
                        for name, value in bound.items()
                        if name in free and isinstance(value, int) and not isinstance(value, bool)
                    )
                )

            return launch

    monkeypatch.setattr(rmsnorm, "_rms_norm_kernel", Catch())
    hidden, weight = 64, torch.ones(64, dtype=torch.bfloat16)
    table = torch.zeros(100, hidden, dtype=torch.bfloat16)
    for rows in (17, 32):
        keys[rows] = []
        x = torch.zeros(rows, hidden, dtype=torch.bfloat16)
        rmsnorm.rms_norm_triton(x, weight, 1e-6)
        rmsnorm.fused_add_rms_norm_triton(x, x.clone(), weight, 1e-6)
        rmsnorm.embed_rms_norm_triton(torch.zeros(rows, dtype=torch.int64), table, weight, 1e-6)
    assert len(keys[17]) == 3 and keys[17] == keys[32]


def test_silu_and_mul_extreme_gates_stay_finite():
    x = torch.tensor([[-1e4, -100.0, 0.0, 100.0, 2.0, 3.0, 4.0, 5.0]], device=DEVICE)
    out = silu_and_mul_triton(x)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, silu_and_mul_ref(x))


# --------------------------------------------------------------------------- rotary + kv write


def _cos_sin(max_pos: int, rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angles = torch.arange(max_pos, dtype=torch.float64).unsqueeze(1) * inv_freq
    return angles.cos().float().to(DEVICE), angles.sin().float().to(DEVICE)


def _qkv_views(tokens, heads, kv_heads, head_dim, dtype, g):
    """q, k, v as the model has them: strided views of one fused projection output."""
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, g=g, dtype=dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return (
        q.view(tokens, heads, head_dim),
        k.view(tokens, kv_heads, head_dim),
        v.view(tokens, kv_heads, head_dim),
    )


# tokens, heads, kv, head_dim, rot; 12 q heads take two programs a token, the second half full
ROTARY_CASES = [(9, 4, 2, 32, 32), (5, 6, 3, 32, 16), (3, 12, 4, 32, 32)]
if CUDA:
    ROTARY_CASES.append((512, 32, 8, 128, 128))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim,rotary_dim", ROTARY_CASES)
def test_rotary_embedding(dtype, tokens, heads, kv_heads, head_dim, rotary_dim):
    g = gen(5)
    cos, sin = _cos_sin(4096, rotary_dim)
    q, k, _ = _qkv_views(tokens, heads, kv_heads, head_dim, dtype, g)
    positions = torch.randint(0, 4096, (tokens,), generator=g).to(DEVICE)
    with poisoned():
        q_out, k_out = rotary_embedding_triton(positions, q, k, cos, sin)
    q_ref, k_ref = rotary_embedding_ref(positions, q, k, cos, sin)
    check(q_out, q_ref, "rotated q")
    check(k_out, k_ref, "rotated k")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim,rotary_dim", ROTARY_CASES)
def test_rotary_and_store_kv(dtype, tokens, heads, kv_heads, head_dim, rotary_dim):
    g = gen(6)
    block_size = 4
    num_blocks = tokens // block_size + 3
    cos, sin = _cos_sin(4096, rotary_dim)
    q, k, v = _qkv_views(tokens, heads, kv_heads, head_dim, dtype, g)
    positions = torch.randint(0, 4096, (tokens,), generator=g).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    slots[:: max(2, tokens // 3)] = -1  # padding tokens write nothing
    slots = slots.to(DEVICE)
    k_cache = nan_cache(num_blocks, block_size, kv_heads, head_dim, dtype)
    v_cache = k_cache.clone()
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    with poisoned():
        q_out = rotary_and_store_kv_triton(positions, q, k, v, cos, sin, k_cache, v_cache, slots)
    q_expected = rotary_and_store_kv_ref(positions, q, k, v, cos, sin, k_ref, v_ref, slots)
    check(q_out, q_expected, "rotated q")
    assert_same_cache(k_cache, k_ref, "k cache")
    assert_same_cache(v_cache, v_ref, "v cache")


QK_NORM_CASES = [(7, 4, 2, 32), (5, 6, 3, 48), (3, 20, 4, 32)]  # tokens, heads, kv, head_dim
if CUDA:
    QK_NORM_CASES.append((64, 32, 8, 128))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", QK_NORM_CASES)
def test_rotary_and_store_kv_with_qk_norm(dtype, tokens, heads, kv_heads, head_dim):
    """Qwen3's per-head q/k RMSNorm fused ahead of the rotation."""
    g = gen(16)
    block_size = 4
    num_blocks = tokens // block_size + 3
    cos, sin = _cos_sin(4096, head_dim)
    q, k, v = _qkv_views(tokens, heads, kv_heads, head_dim, dtype, g)
    q, k = 4.0 * q, 0.25 * k  # the norm must undo the scale
    positions = torch.randint(0, 4096, (tokens,), generator=g).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens].to(DEVICE)
    qk_norm = (randn(head_dim, g=g, dtype=dtype), randn(head_dim, g=g, dtype=dtype), 1e-6)
    k_cache = nan_cache(num_blocks, block_size, kv_heads, head_dim, dtype)
    v_cache = k_cache.clone()
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    with poisoned():
        q_out = rotary_and_store_kv_triton(
            positions, q, k, v, cos, sin, k_cache, v_cache, slots, qk_norm
        )
    q_expected = rotary_and_store_kv_ref(positions, q, k, v, cos, sin, k_ref, v_ref, slots, qk_norm)
    check(q_out, q_expected, "normed, rotated q")
    assert_same_cache(k_cache, k_ref, "normed k cache")
    assert_same_cache(v_cache, v_ref, "v cache")
    # The fused reference equals norm-then-rope done separately.
    q_normed = rms_norm_ref(q, qk_norm[0], 1e-6)
    k_normed = rms_norm_ref(k, qk_norm[1], 1e-6)
    k_sep, v_sep = k_cache.clone().fill_(float("nan")), v_cache.clone().fill_(float("nan"))
    q_sep = rotary_and_store_kv_ref(positions, q_normed, k_normed, v, cos, sin, k_sep, v_sep, slots)
    assert torch.equal(q_sep, q_expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv(dtype):
    g = gen(7)
    tokens, kv_heads, head_dim, block_size, num_blocks = 11, 2, 24, 4, 6
    _, k, v = _qkv_views(tokens, 2, kv_heads, head_dim, dtype, g)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    slots[3] = -1
    slots = slots.to(DEVICE)
    k_cache = nan_cache(num_blocks, block_size, kv_heads, head_dim, dtype)
    v_cache = k_cache.clone()
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv_triton(k, v, k_cache, v_cache, slots)
    store_kv_ref(k, v, k_ref, v_ref, slots)
    assert_same_cache(k_cache, k_ref, "k cache")
    assert_same_cache(v_cache, v_ref, "v cache")
    assert torch.equal(k_cache[~k_ref.isnan()], k_ref[~k_ref.isnan()])  # a plain copy


# --------------------------------------------------------------------------- in the model


@contextlib.contextmanager
def kernels_forced(on: bool) -> Iterator[None]:
    """Make every dispatcher pick Triton (``on``) or the reference, whatever the device."""
    import kernels.activation
    import kernels.attention
    import kernels.rmsnorm
    import kernels.rotary

    modules = [kernels.activation, kernels.attention, kernels.rmsnorm, kernels.rotary]
    saved = [m.use_triton for m in modules]
    for module in modules:
        module.use_triton = lambda tensor: on
    try:
        yield
    finally:
        for module, original in zip(modules, saved):
            module.use_triton = original


@pytest.mark.skipif(CUDA, reason="on a GPU the golden tests run these kernels in the model")
def test_tiny_qwen3_runs_the_same_on_triton_kernels(tmp_path):
    """The real model layout (strided qkv views, per-head norms, chunked prefill mixed
    with decodes, decode-only steps) through the dispatchers, Triton against references."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from worker_helpers import engine_config, make_tiny_checkpoint, mixed_greedy_tokens

    from worker_proc.model_runner import ModelRunner

    runner = ModelRunner(engine_config(make_tiny_checkpoint(str(tmp_path), "qwen3", seed=1)))
    prompt = list(range(5, 27))
    with kernels_forced(False):
        expected = runner.prefill_logits(prompt)
    with kernels_forced(True):
        logits = runner.prefill_logits(prompt)
    assert rel_err(logits, expected) < 1e-5, f"seed {SEED}"

    with kernels_forced(False):
        expected_tokens = mixed_greedy_tokens(runner)
    with kernels_forced(True):
        assert mixed_greedy_tokens(runner) == expected_tokens


# --------------------------------------------------------------------------- dispatch


def test_dispatch_keeps_cpu_tensors_on_the_references():
    assert not use_triton(torch.zeros(1))


def test_importing_the_engine_path_does_not_import_triton():
    root = Path(__file__).resolve().parent.parent
    code = (
        "import sys, kernels, kernels.decode_attention, kernels.prefill_attention\n"
        "import worker_proc.layers.attention\n"
        "assert 'triton' not in sys.modules, 'triton imported'\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def test_disable_env_forces_references(monkeypatch):
    import kernels.backend as backend

    for env_var, value in (("PEGAINFER_DISABLE_TRITON", "1"), ("PEGAINFER_KERNELS", "ref")):
        with monkeypatch.context() as patch:
            patch.setenv(env_var, value)
            backend._triton_available.cache_clear()
            try:
                assert not backend._triton_available(), env_var
            finally:
                backend._triton_available.cache_clear()
    assert backend._triton_available()
