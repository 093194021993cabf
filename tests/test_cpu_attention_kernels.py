"""The cpu_paged backend's prefill attention (two matmuls around our causal softmax) and its bf16 decode K pass by
vdpbf16ps, each against a float64 reference; both branches of the ISA-dependent K pass."""
from __future__ import annotations

import contextlib
import random

import pytest
import torch

from llmrt.attention.cpu_paged import CpuPagedAttentionBackend, load_kernel, prefill_attention
from llmrt.attention.torch_sdpa import TorchAttentionBackend
from llmrt.hardware import cpu_flags, kernel_isa
from tests.conftest import requires_compiler

pytestmark = requires_compiler
HAS_BF16DOT = kernel_isa() == "avx512" and "avx512_bf16" in cpu_flags()


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


# (queries, context, window, heads, kv heads, head dim): spans longer than a query chunk (128), spans after
# earlier chunks of their sequence (context > queries), sliding windows inside and across chunks, MHA and GQA,
# a head dim off the vector width, single-token spans.
CASES = [(37, 37, 0, 12, 4, 64), (300, 300, 0, 12, 4, 64), (150, 400, 0, 8, 2, 32), (260, 260, 50, 6, 6, 24),
         (1, 1, 0, 4, 2, 64), (1, 90, 0, 4, 1, 64), (200, 333, 170, 12, 4, 64)]


@pytest.mark.parametrize("case", CASES, ids=[f"n{c[0]}-ctx{c[1]}-w{c[2]}-h{c[3]}/{c[4]}-d{c[5]}" for c in CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_prefill_attention_matches_float64(case, dtype):
    n, ctx, window, heads, kv_heads, dim = case
    g = torch.Generator().manual_seed(n + ctx)
    q = torch.randn(n, heads, dim, generator=g).to(dtype)
    k = torch.randn(ctx, kv_heads, dim, generator=g).to(dtype)
    v = torch.randn(ctx, kv_heads, dim, generator=g).to(dtype)
    got = prefill_attention(q, k, v, dim ** -0.5, window)
    want = _reference(q, k, v, dim ** -0.5, window)
    assert got.dtype == dtype and got.shape == q.shape
    # float32: summation order only; bf16: the output's own rounding (2^-9 relative) plus bf16 probabilities
    atol, rtol = (2e-5, 1e-4) if dtype == torch.float32 else (2e-2, 2e-2)
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=rtol)


def test_prefill_attention_is_no_worse_than_torch_sdpa_in_bf16():
    # bf16 probabilities for the P V matmul, as a bf16 flash kernel keeps them: within 2x of SDPA's own error.
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(300, h, 64, generator=g).bfloat16() for h in (12, 4, 4))

    class Layer:
        scale, sliding_window, gqa = 0.125, None, True

    want = _reference(q, k, v, 0.125, 0)
    ours = (prefill_attention(q, k, v, 0.125, 0).double() - want).abs().mean()
    sdpa = (TorchAttentionBackend._prefill(Layer, q, k, v, None).double() - want).abs().mean()
    assert ours < 2 * sdpa


def test_prefill_softmax_rows_are_probabilities_zero_where_masked():
    softmax = load_kernel().prefill_softmax
    n, ctx, offset, window = 5, 40, 30, 7
    s = torch.randn(3 * n, ctx) * 4  # 3 query heads x 5 queries at positions 30..34 (rows of ctx 40; last 5 unused)
    p = softmax(s, n, offset, 0.5, window, torch.float32)
    for r in range(3 * n):
        pos = offset + r % n
        lo = pos + 1 - window
        assert not p[r, :lo].any() and not p[r, pos + 1:].any()
        torch.testing.assert_close(p[r, lo:pos + 1], torch.softmax(s[r, lo:pos + 1] * 0.5, -1))
    pb = softmax(s, n, offset, 0.5, window, torch.bfloat16)
    assert pb.dtype == torch.bfloat16 and torch.equal(pb, p.bfloat16())  # rounded to nearest even, as .bfloat16()
    with pytest.raises(RuntimeError, match="whole spans"):
        softmax(s, 4, offset, 0.5, 0, torch.float32)


def test_the_backend_prefills_through_it_and_the_switch_falls_back(monkeypatch):
    calls = []
    import llmrt.attention.cpu_paged as cpu_paged

    real = cpu_paged.prefill_attention
    monkeypatch.setattr(cpu_paged, "prefill_attention", lambda *a: calls.append(1) or real(*a))

    class Layer:
        scale, sliding_window, gqa = 0.125, None, True

    q, k, v = torch.randn(9, 4, 64), torch.randn(9, 2, 64), torch.randn(9, 2, 64)
    a = CpuPagedAttentionBackend._prefill(Layer, q, k, v, None)
    assert calls == [1]
    monkeypatch.setenv("LLMRT_PREFILL_ATTENTION", "0")
    b = CpuPagedAttentionBackend._prefill(Layer, q, k, v, None)
    assert calls == [1]
    torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


@contextlib.contextmanager
def _bf16dot(on: bool):
    before = load_kernel().set_bf16dot(on)
    try:
        yield
    finally:
        load_kernel().set_bf16dot(before)


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


BRANCHES = [False, pytest.param(True, marks=pytest.mark.skipif(not HAS_BF16DOT, reason="no AVX512-BF16 here"))]


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
