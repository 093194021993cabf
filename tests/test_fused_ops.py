"""The fused CPU layer ops (llmrt/model/layers/fused.py) against the layers' torch paths, both builds, fp32 and bf16."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmrt.hardware import cpu_flags
from llmrt.kernels import ISA_NEEDS
from llmrt.model.layers import fused
from llmrt.model.layers.activation import GatedActivation, gated
from llmrt.model.layers.norms import RMSNorm
from llmrt.model.layers.rotary import RotaryEmbedding

ISAS = [isa for isa, needs in ISA_NEEDS.items() if set(needs) <= cpu_flags()] + ["generic"]


def _ops(isa: str) -> fused.FusedOps:
    return fused.load(isa)  # a build failure fails the test (make installs a compiler's output first)


def _torch_norm(norm: RMSNorm, x, residual=None):
    norm.fused = False
    try:
        return norm(x.clone(), None if residual is None else residual.clone())
    finally:
        norm.fused = True


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 70])
def test_rms_norm_and_add_rms_norm_match_torch(isa, dtype, rows):
    ops = _ops(isa)
    g = torch.Generator().manual_seed(rows)
    dim = 768
    norm = RMSNorm(dim, 1e-5)
    norm.weight.data = (torch.randn(dim, generator=g) * 0.2 + 1).to(dtype)
    x = (torch.randn(rows, dim, generator=g) * 3).to(dtype)
    res = torch.randn(rows, dim, generator=g).to(dtype)
    want = _torch_norm(norm, x)
    got = ops.rms_norm(x, norm.weight, norm.eps)
    want_y, want_r = _torch_norm(norm, x, res)
    xs, rs = x.clone(), res.clone()
    ops.add_rms_norm_(xs, rs, norm.weight, norm.eps)
    # The sum of squares is reduced in another order than torch's: fp32 within a few ulp. bf16 rounds twice
    # (x * inv, then weight * that) from values an fp32 ulp apart: at most two bf16 ulps (2**-6 relative).
    tol = dict(rtol=2e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -6, atol=1e-3)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(xs, want_y, **tol)
    assert torch.equal(rs, want_r)  # the residual sum is one rounding of x + residual, as torch's add


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_is_bitwise_the_torch_path(isa, dtype):
    ops = _ops(isa)
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, tokens = 12, 4, 64, 9
    rope = RotaryEmbedding(dim, 4096, {"rope_theta": 10000.0, "rope_type": "default"})
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim)  # strided views, as in the model
    positions = torch.tensor([0, 1, 2, 7, 100, 511, 1000, 2047, 4095])
    rope.fused = False
    want_q, want_k = rope(positions, q, k)
    ops.rotary_(q, k, positions, rope.cos, rope.sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)  # same products, same rounding, no FMA


def test_rotary_refuses_positions_outside_its_table():
    ops = _ops(ISAS[0])
    rope = RotaryEmbedding(8, 16, {"rope_theta": 10000.0, "rope_type": "default"})
    q, k = torch.zeros(1, 2, 8), torch.zeros(1, 1, 8)
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        ops.rotary_(q, k, torch.tensor([16]), rope.cos, rope.sin)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 40])
def test_silu_mul_matches_torch(isa, dtype, rows):
    ops = _ops(isa)
    g = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * 2048, generator=g) * 4).to(dtype)
    gate_up[0, :6] = torch.tensor([-100.0, -88.0, 0.0, 88.0, 100.0, -1e-3])  # exp's clamps and the origin
    want = gated(F.silu, gate_up)
    got = ops.silu_mul(gate_up)
    # Our exp is Cephes' polynomial (~1 ulp) where torch uses Sleef's: fp32 a few ulp; bf16 then one rounding.
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-3)
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_is_torch_argmax_with_ties_nan_and_infinities(isa, dtype):
    """Every row's index equals torch.argmax's: first of tied maxima, the first NaN, -inf rows, signed zeros."""
    ops = _ops(isa)
    g = torch.Generator().manual_seed(7)
    for vocab in (1, 7, 8, 9, 33, 1000, 32000):
        x = torch.randn(12, vocab, generator=g)
        x[1] = torch.randint(-2, 2, (vocab,), generator=g).float()  # many ties
        x[2] = float("-inf")
        x[3, vocab // 2:] = float("nan")  # a NaN after the maximum
        x[4, -1] = float("inf")
        x[4, vocab // 3] = float("inf")  # the first of two +inf
        x[5] = torch.where(torch.rand(vocab, generator=g) < 0.5, 0.0, -0.0)
        x[6, ::3] = float("nan")
        x[7, -1] = x[7].max() + 1  # the maximum in the tail past the last full register
        x[8, 0] = float("nan")
        x[9] = x[9].max()  # all equal
        x[10, vocab - 1] = float("nan")
        x[10, 0] = float("inf")
        x = x.to(dtype)
        for t in (x, torch.cat([x, x], 1)[:, 1:vocab + 1]):  # contiguous rows, then rows apart by 2 * vocab
            assert torch.equal(ops.argmax(t), torch.argmax(t, -1)), (vocab, t)
    assert ops.argmax(torch.randn(0, 5).to(dtype)).shape == (0,)


def test_sampler_argmax_takes_the_kernel_and_falls_back(monkeypatch):
    from llmrt.model.layers import sampler
    logits = torch.randn(3, 100)
    assert torch.equal(sampler._argmax(logits), logits.argmax(-1))
    ops = fused.fused_ops()
    if ops is not None:
        calls = []

        class Counting:
            def argmax(self, t):
                calls.append(t)
                return ops.argmax(t)

        monkeypatch.setattr(sampler, "ops_for", lambda x, on: Counting())
        assert torch.equal(sampler._argmax(logits), logits.argmax(-1)) and len(calls) == 1
    # a column slice (last stride not 1) goes to torch
    t = torch.randn(4, 10)[:, ::2]
    assert torch.equal(sampler._argmax(t), t.argmax(-1))


def test_layers_take_the_torch_path_when_told_or_off_cpu(monkeypatch):
    calls = []
    act = GatedActivation("silu")
    monkeypatch.setattr(fused, "fused_ops", lambda: calls.append(1) or None)
    x = torch.randn(2, 8)
    act.fused = False
    torch.testing.assert_close(act(x), gated(F.silu, x))
    assert not calls  # the flag alone keeps torch's ops (what --deterministic sets)
    act.fused = True
    act(x)
    assert calls
    calls.clear()
    act(torch.randn(17, 8))  # beyond FUSED_SILU_MAX_ROWS torch's silu and mul are faster in fp32 (activation.py)
    assert not calls
    act(torch.randn(300, 8).bfloat16())  # bf16 takes the fused pass at every size
    assert calls
    calls.clear()
    assert GatedActivation("gelu_new")(x).shape == (2, 4)  # not SiLU: torch's ops


def test_set_fused_reaches_every_layer_of_a_model():
    from torch import nn

    model = nn.Sequential(RMSNorm(8), GatedActivation("silu"),
                          RotaryEmbedding(8, 4, {"rope_theta": 1e4, "rope_type": "default"}))
    assert fused.set_fused(model, False) == 3
    assert not any(getattr(m, "fused", False) for m in model.modules())
