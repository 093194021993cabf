"""The cpu_paged backend's fused prefill attention and its bf16 decode K pass by vdpbf16ps, each against a float64
reference; both branches of the ISA-dependent K pass."""
from __future__ import annotations

import contextlib
import random

import pytest
import torch

from llmrt.attention.cpu_paged import CpuPagedAttentionBackend, load_kernel, prefill_attention
from llmrt.attention.torch_sdpa import TorchAttentionBackend
from llmrt.hardware import cpu_flags, kernel_isa

HAS_BF16DOT = kernel_isa() == "avx512" and "avx512_bf16" in cpu_flags()
BRANCHES = [False, pytest.param(True, marks=pytest.mark.skipif(not HAS_BF16DOT, reason="no AVX512-BF16 here"))]


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int) -> torch.Tensor:
    """float64 causal attention of q [n, H, D] (the last n positions) over k, v [ctx, KVH, D]."""
    n, heads, _ = q.shape
    ctx, kv_heads = k.shape[0], k.shape[1]
    ks = k.double().repeat_interleave(heads // kv_heads, 1)
    vs = v.double().repeat_interleave(heads // kv_heads, 1)
    s = torch.einsum("nhd,thd->hnt", q.double(), ks) * scale
    qpos = torch.arange(ctx - n, ctx)[:, None]
    kpos = torch.arange(ctx)[None, :]
    visible = kpos <= qpos
    if window:
        visible &= kpos > qpos - window
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), -1)
    return torch.einsum("hnt,thd->nhd", p, vs)


@contextlib.contextmanager
def _bf16dot(on: bool):
    before = load_kernel().set_bf16dot(on)
    try:
        yield
    finally:
        load_kernel().set_bf16dot(before)


# (queries, context, window, heads, kv heads, head dim): spans longer than a work unit's 32 positions, spans after
# earlier chunks of their sequence (context > queries), sliding windows inside and across key blocks, MHA and GQA,
# head dims from 16 to 256, single-token spans.
CASES = [(37, 37, 0, 12, 4, 64), (300, 300, 0, 12, 4, 64), (150, 400, 0, 8, 2, 32), (260, 260, 50, 6, 6, 128),
         (1, 1, 0, 4, 2, 64), (1, 90, 0, 4, 1, 64), (200, 333, 170, 12, 4, 64), (5, 21, 3, 2, 1, 256),
         (40, 40, 0, 3, 3, 16)]


def _qkv(n: int, ctx: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype, seed: int):
    """q, k, v as the backend passes them: views of one projection output, rows strided."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(ctx, heads + 2 * kv_heads, dim, generator=g).to(dtype)
    return qkv[ctx - n:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]


@pytest.mark.parametrize("case", CASES, ids=[f"n{c[0]}-ctx{c[1]}-w{c[2]}-h{c[3]}/{c[4]}-d{c[5]}" for c in CASES])
@pytest.mark.parametrize("dtype,bf16dot", [(torch.float32, False), (torch.bfloat16, False),
                                           pytest.param(torch.bfloat16, True, marks=pytest.mark.skipif(
                                               not HAS_BF16DOT, reason="no AVX512-BF16 here"))],
                         ids=["f32", "bf16-fma", "bf16-vdpbf16ps"])
def test_prefill_attention_matches_float64(case, dtype, bf16dot):
    n, ctx, window, heads, kv_heads, dim = case
    q, k, v = _qkv(n, ctx, heads, kv_heads, dim, dtype, n + ctx)
    if not load_kernel().prefill_supports(dim):  # e.g. 256 on AVX2 (8 lanes x 32): the backend falls back to SDPA
        assert prefill_attention(q, k, v, dim ** -0.5, window) is None
        return
    with _bf16dot(bf16dot):
        got = prefill_attention(q, k, v, dim ** -0.5, window)
    want = _reference(q, k, v, dim ** -0.5, window)
    assert got.dtype == dtype and got.shape == q.shape
    # float32: summation order only; bf16: the output's own rounding (2^-9 relative)
    atol, rtol = (2e-5, 1e-4) if dtype == torch.float32 else (1e-2, 1e-2)
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=rtol)
    with _bf16dot(bf16dot):
        contiguous = prefill_attention(q.contiguous(), k.contiguous(), v.contiguous(), dim ** -0.5, window)
    assert torch.equal(got, contiguous)


class _Layer:
    scale, sliding_window, gqa = 0.125, None, True


def test_prefill_attention_is_as_accurate_as_torch_sdpa():
    for dtype, bf16dot in ((torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, HAS_BF16DOT)):
        q, k, v = _qkv(300, 300, 12, 4, 64, dtype, 0)
        want = _reference(q, k, v, 0.125, 0)
        with _bf16dot(bf16dot):
            ours = (prefill_attention(q, k, v, 0.125, 0).double() - want).abs().mean()
        sdpa = (TorchAttentionBackend._prefill(_Layer, q, k, v, None).double() - want).abs().mean()
        assert ours < 1.2 * sdpa, (dtype, bf16dot, ours, sdpa)


@pytest.mark.parametrize("bf16dot", BRANCHES, ids=["fma", "vdpbf16ps"])
def test_prefill_attention_does_not_depend_on_the_thread_count(bf16dot):
    q, k, v = _qkv(130, 200, 12, 4, 64, torch.bfloat16, 3)
    before = torch.get_num_threads()
    try:
        with _bf16dot(bf16dot):
            torch.set_num_threads(1)
            one = prefill_attention(q, k, v, 0.125, 0)
            torch.set_num_threads(2)
            assert torch.equal(one, prefill_attention(q, k, v, 0.125, 0))
    finally:
        torch.set_num_threads(before)


def test_the_backend_prefills_through_it_and_falls_back_to_sdpa(monkeypatch):
    calls = []
    import llmrt.attention.cpu_paged as cpu_paged

    real = cpu_paged.prefill_attention
    monkeypatch.setattr(cpu_paged, "prefill_attention", lambda *a: calls.append(1) or real(*a))
    q, k, v = torch.randn(9, 4, 64), torch.randn(9, 2, 64), torch.randn(9, 2, 64)
    a = CpuPagedAttentionBackend._prefill(_Layer, q, k, v, None)
    assert calls == [1]
    sdpa = TorchAttentionBackend._prefill(_Layer, q, k, v, None)
    torch.testing.assert_close(a, sdpa, atol=2e-5, rtol=1e-4)
    monkeypatch.setenv("LLMRT_PREFILL_ATTENTION", "0")
    cpu_paged.prefill_kernel.cache_clear()  # the switch is read once per head dim
    try:
        assert real(q, k, v, 0.125, 0) is None
        torch.testing.assert_close(CpuPagedAttentionBackend._prefill(_Layer, q, k, v, None), sdpa, atol=0, rtol=0)
    finally:
        monkeypatch.delenv("LLMRT_PREFILL_ATTENTION")
        cpu_paged.prefill_kernel.cache_clear()
    odd = torch.randn(9, 4, 24), torch.randn(9, 2, 24), torch.randn(9, 2, 24)  # head dim off the vector width
    assert not load_kernel().prefill_supports(24) and real(*odd, 0.125, 0) is None
    assert CpuPagedAttentionBackend._prefill(_Layer, *odd, None).shape == (9, 4, 24)


def test_prefill_attention_refuses_bad_shapes_clearly():
    op = load_kernel().prefill_attention
    with pytest.raises(RuntimeError, match="multiple of KVH"):
        op(torch.randn(4, 5, 64), torch.randn(4, 2, 64), torch.randn(4, 2, 64), 0.125, 0)
    with pytest.raises(RuntimeError, match="ctx >= n"):
        op(torch.randn(8, 4, 64), torch.randn(4, 2, 64), torch.randn(4, 2, 64), 0.125, 0)
    with pytest.raises(RuntimeError, match="share a dtype"):
        op(torch.randn(4, 4, 64), torch.randn(4, 2, 64).bfloat16(), torch.randn(4, 2, 64), 0.125, 0)


def _decode_case(dim: int, n: int = 24, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, bs = 12, 4, 16
    lens = torch.tensor([random.Random(seed + i).randint(1, 150) for i in range(n)])
    width = 10
    tables = torch.randperm(n * width, generator=g).view(n, width)
    k_cache = torch.randn(n * width, bs, kv_heads, dim, generator=g).bfloat16()
    v_cache = torch.randn(n * width, bs, kv_heads, dim, generator=g).bfloat16()
    q = torch.randn(n, heads, dim, generator=g).bfloat16()
    return q, k_cache, v_cache, tables, lens




@pytest.mark.parametrize("bf16dot", BRANCHES, ids=["fma", "vdpbf16ps"])
@pytest.mark.parametrize("dim", [64, 128])
def test_bf16_decode_matches_float64_on_both_k_pass_branches(bf16dot, dim):
    q, k_cache, v_cache, tables, lens = _decode_case(dim)
    with _bf16dot(bf16dot):
        got = load_kernel().decode(q, k_cache, v_cache, tables, lens, dim ** -0.5, 0)
    for s in range(q.shape[0]):
        m = int(lens[s])
        ks = k_cache[tables[s]].reshape(-1, 4, dim)[:m]
        vs = v_cache[tables[s]].reshape(-1, 4, dim)[:m]
        want = _reference(q[s:s + 1], ks, vs, dim ** -0.5, 0)[0]
        torch.testing.assert_close(got[s].double(), want, atol=1e-2, rtol=1e-2)  # the bf16 output's rounding


@pytest.mark.parametrize("bf16dot", BRANCHES, ids=["fma", "vdpbf16ps"])
def test_bf16_decode_does_not_depend_on_the_batch(bf16dot):
    q, k_cache, v_cache, tables, lens = _decode_case(64)
    kernel = load_kernel().decode
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with _bf16dot(bf16dot):
            whole = kernel(q, k_cache, v_cache, tables, lens, 0.125, 0)
            alone = torch.cat([kernel(q[i:i + 1], k_cache, v_cache, tables[i:i + 1], lens[i:i + 1], 0.125, 0)
                               for i in range(q.shape[0])])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(whole, alone)


@pytest.mark.skipif(not HAS_BF16DOT, reason="no AVX512-BF16 here")
def test_the_loader_turns_vdpbf16ps_on_where_the_capability_table_has_it():
    on = load_kernel().set_bf16dot(True)  # returns the setting the loader left
    load_kernel().set_bf16dot(on)
    assert on
