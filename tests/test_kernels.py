"""llmrt's CPU linear kernels (llmrt/kernels): each ISA build against a float64 reference on odd shapes, rows that
do not depend on the batch, the layers' choice between our kernels and torch's paths, and the fallback."""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
import torch.nn.functional as F

import llmrt.kernels as K
from llmrt.config import ModelConfig
from llmrt.engine.llm import LLM
from llmrt.hardware import cpu_flags, kernel_isa
from llmrt.kernels.packed import PackedLinear
from llmrt.model.layers.linear import Linear
from llmrt.model.quantization.int4 import pack_int4_chunks, quantize_int4, unpack_int4_chunks
from llmrt.model.quantization.int8 import quantize_int8
from llmrt.sampling_params import SamplingParams

ISAS = [isa for isa, needs in K.ISA_NEEDS.items() if set(needs) <= cpu_flags()]
pytestmark = pytest.mark.skipif(not ISAS, reason="this CPU has no AVX2+FMA: only torch's paths exist")
# (out, in): K not a multiple of 8/16/32 or of the group, N not a multiple of the 4-row tile, a tiny one.
SHAPES = [(37, 100), (64, 320), (5, 7), (130, 64)]
ROWS = [1, 2, 3, 5, 8, 17, 64]


def _weights(lib: K.KernelLib, n: int, k: int, fmt: str, bias=None, int8_act: bool = False,
             batched: bool = False) -> tuple[PackedLinear, torch.Tensor]:
    """(the packed layer, the dense fp64 weights it stands for); int8/int4 with fp32 or int8 activations. The
    vector kernels unless `batched` (then int8/int4 bf16 steps run the batched kernel the CPU has: AMX tiles, or
    vdpbf16ps panels)."""
    p, dense = _packed(lib, n, k, fmt, bias, int8_act)
    return dataclasses.replace(p, batch=p.batch if batched else ""), dense


def _packed(lib: K.KernelLib, n: int, k: int, fmt: str, bias, int8_act: bool) -> tuple[PackedLinear, torch.Tensor]:
    w = torch.randn(n, k)
    if fmt in ("fp32", "bf16"):
        w = w.bfloat16() if fmt == "bf16" else w
        return PackedLinear.dense(lib, w, bias), w.double()
    if fmt == "int8":
        q, s = quantize_int8(w)
        p = dataclasses.replace(PackedLinear.dense(lib, q, bias, s), int8_act=int8_act)
        return p, q.double() * s.double()[:, None]
    kp = k + (-k % 32)
    q, sc, z = quantize_int4(F.pad(w, (0, kp - k)), 32)
    sz = torch.stack([sc, z], -1).bfloat16()
    s, zz = sz[..., 0].double(), sz[..., 1].double()
    dense = ((q.double().view(n, -1, 32) - 8) * s[..., None] + zz[..., None]).view(n, kp)[:, :k]
    return dataclasses.replace(PackedLinear.int4(lib, q, sc, z, 32, k, bias), int8_act=int8_act), dense


def _quantized_x(x: torch.Tensor, kp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x zero-padded to kp and quantized per block of 32 as the int8-activation kernels do (fp32 arithmetic):
    (the dequantized values, each element's block scale d), both float64."""
    xb = F.pad(x.float(), (0, kp - x.shape[1])).view(x.shape[0], -1, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.full_like(amax, 127.0).div(amax)  # a true division (torch's 127.0 / t multiplies by 1 / t)
    q = torch.round(xb * torch.where(amax > 0, inv, torch.zeros_like(amax))).clamp(-127, 127)
    d = (amax / 127.0).expand_as(xb)
    return (q * d).reshape(x.shape[0], kp).double(), d.reshape(x.shape[0], kp).double()


def _blocks(x: torch.Tensor, kp: int, block: int) -> torch.Tensor:
    """x [rows, k] zero-padded to kp, then to whole blocks: [rows, blocks, block] (the last block's padding is
    zeros, which the kernels' block maxima do not see either)."""
    return F.pad(x, (0, kp - x.shape[1] + (-kp % block))).view(x.shape[0], -1, block)


def _int16_rounding(x: torch.Tensor, p: PackedLinear, block: int) -> torch.Tensor:
    """The most that rounding x to int16 per block of `block` inputs (d = max|x| / 32767, |x - xq| <= d / 2 an
    element, csrc/int_i16.h, int8_i16dot.h) moves int8/int4 layer p's x @ w.T: the rounded activations multiply w
    (int8) or (q - 8) s = w - z (int4)."""
    kp = p.padded_in
    w = p.unpack_into(torch.empty(p.n, kp)).double()
    if p.fmt == "int4":
        z = p.sz.view(-1, kp // p.group_size, 4, 2)[..., 1].permute(0, 2, 1).reshape(-1, kp // p.group_size)[:p.n]
        w = w - z.double().repeat_interleave(p.group_size, -1)
    xb = _blocks(x.double(), kp, block)
    d = (xb.abs().amax(-1, keepdim=True) / 32767).expand_as(xb).reshape(x.shape[0], -1)[:, :kp]
    return (d / 2 + 1e-7 * xb.abs().reshape(x.shape[0], -1)[:, :kp]) @ w.abs().T


def _without_bias(p: PackedLinear) -> PackedLinear:
    return dataclasses.replace(p, bias=None)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "int4"])
def test_kernel_matches_reference(isa, fmt):
    """fp32 accumulation: error within 1e-5 of sum|x||w| (fp32 out), plus bf16 rounding of the output (bf16 out),
    plus, for int8/int4 on AVX2 builds, the int16 rounding of the activations (at most d / 2 an element)."""
    torch.manual_seed(0)
    lib = K.load(isa)
    for n, k in SHAPES:
        bias = torch.randn(n).bfloat16()
        packed, dense = _weights(lib, n, k, fmt, bias)
        for rows in ROWS:
            for xdt in (torch.float32, torch.bfloat16):
                x = torch.randn(rows, k).to(xdt)
                with_bias = rows % 2 == 1
                ref = x.double() @ dense.T + (bias.double() if with_bias else 0)
                scale = x.double().abs() @ dense.abs().T
                y = packed(x) if with_bias else _without_bias(packed)(x)
                assert y.dtype == xdt and y.shape == (rows, n)
                tol = 1e-5 * scale + 1e-6 + (ref.abs() * 2 ** -8 if xdt == torch.bfloat16 else 0)
                if fmt in ("int8", "int4") and K.int16_block(isa, fmt):
                    tol = tol + _int16_rounding(x, packed, K.int16_block(isa, fmt))
                assert ((y.double() - ref).abs() <= tol).all(), (isa, fmt, n, k, rows, xdt)


def _int4_parts(lib: K.KernelLib, n: int, k: int, bias) -> tuple[PackedLinear, torch.Tensor, torch.Tensor]:
    """int4 weights with int8 activations: (the packed layer, the q*scale part, the zero - 8*scale part), the two
    parts dense float64 [n, k padded to 32] (the weights are their sum)."""
    kp = k + (-k % 32)
    q, sc, z = quantize_int4(F.pad(torch.randn(n, k), (0, kp - k)), 32)
    sz = torch.stack([sc, z], -1).bfloat16().double()
    s, zz = sz[..., 0][..., None], sz[..., 1][..., None]
    qs = (q.double().view(n, -1, 32) * s).view(n, kp)
    off = (zz - 8 * s).expand(n, kp // 32, 32).reshape(n, kp)
    return dataclasses.replace(PackedLinear.int4(lib, q, sc, z, 32, k, bias), int8_act=True), qs, off


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_int8_activation_kernels_match_reference(isa, fmt):
    """Integer dot products (qdot.h) on odd shapes: within fp32 rounding of the float64 product of the weights and
    the per-block-quantized activations (int4's offset term uses the exact activation sums), and within the
    rounding bound (d/2 per element) of the unquantized activations' product."""
    torch.manual_seed(4)
    lib = K.load(isa)
    for n, k in SHAPES:
        bias = torch.randn(n).bfloat16()
        if fmt == "int8":
            packed, wd = _weights(lib, n, k, fmt, bias, int8_act=True)
            wd = F.pad(wd, (0, packed.padded_in - k))
            qs, off = wd, torch.zeros_like(wd)
        else:
            packed, qs, off = _int4_parts(lib, n, k, bias)
            wd = qs + off
        kp = packed.padded_in
        for rows in ROWS:
            for xdt in (torch.float32, torch.bfloat16):
                x = torch.randn(rows, k).to(xdt)
                xq, d = _quantized_x(x, kp)
                xf = F.pad(x.double(), (0, kp - k))
                ref = xq @ qs.T + xf @ off.T + bias.double()
                y = packed(x)
                assert y.dtype == xdt and y.shape == (rows, n)
                out_round = ref.abs() * 2 ** -8 if xdt == torch.bfloat16 else 0
                tol = 1e-5 * (xf.abs() @ wd.abs().T + xf.abs() @ off.abs().T) + 1e-6 + out_round
                assert ((y.double() - ref).abs() <= tol).all(), (isa, fmt, n, k, rows, xdt)
                bound = (d / 2) @ qs.abs().T + tol  # activation rounding: |x - xq| <= d/2 per element
                assert ((y.double() - (xf @ wd.T + bias.double())).abs() <= bound).all(), (isa, fmt, n, k, rows)


def _int16_rounded(x: torch.Tensor, kp: int, block: int) -> torch.Tensor:
    """x zero-padded to kp and rounded to int16 per block of `block` inputs as csrc/int_i16.h and int8_i16dot.h do
    (fp32 arithmetic), float64."""
    xb = _blocks(x.float(), kp, block)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 32767.0) / amax, torch.zeros_like(amax))
    return (torch.round(xb * inv) * (amax / 32767)).view(x.shape[0], -1)[:, :kp].double()


@pytest.mark.parametrize("isa,fmt,gs", [(isa, fmt, gs) for isa in ISAS
                                         for fmt, gs in [("int8", 0), ("int4", 32), ("int4", 64), ("int4", 128)]
                                         if K.int16_block(isa, fmt)])  # int8 without VNNI widens to fp32
def test_int_kernels_with_int16_activations(isa, fmt, gs):
    """csrc/int_i16.h and int8_i16dot.h: within fp32 rounding of the float64 product of the int16-rounded
    activations (per block of 32 or 256, as the kernel rounds them) with the weights (int4: with (q - 8) s, plus the
    exact activations times the zero points); the integer sums are exact, so only the float steps after them may
    differ."""
    torch.manual_seed(5)
    lib = K.load(isa)
    for n, k in [(37, 100), (64, 320), (5, 7), (130, 64)]:
        bias = torch.randn(n).bfloat16()
        if fmt == "int8":
            q, sc = quantize_int8(torch.randn(n, k))
            p = dataclasses.replace(PackedLinear.dense(lib, q, bias, sc), batch="")
            kp = p.padded_in
            centred, zz = F.pad(q.double() * sc.double()[:, None], (0, kp - k)), torch.zeros(n, kp).double()
        else:
            kp = k + (-k % gs)
            q, sc, z = quantize_int4(F.pad(torch.randn(n, k), (0, kp - k)), gs)
            # the int16 kernel itself, also for bf16 activations on CPUs whose int4 x bf16 steps take vdpbf16ps
            p = dataclasses.replace(PackedLinear.int4(lib, q, sc, z, gs, k, bias), batch="", bf16dot=False)
            sz = torch.stack([sc, z], -1).bfloat16().double()
            s, zz = sz[..., 0].repeat_interleave(gs, -1), sz[..., 1].repeat_interleave(gs, -1)
            centred = (q.double() - 8) * s
        for rows in (1, 2, 3, 5, 16, 17, 64):  # register tiles up to TILE_ROWS (16), panels above
            for xdt in (torch.float32, torch.bfloat16):
                x = torch.randn(rows, k).to(xdt)
                xf = F.pad(x.double(), (0, kp - k))
                ref = _int16_rounded(x, kp, K.int16_block(isa, fmt)) @ centred.T + xf @ zz.T + bias.double()
                y = p(x)
                tol = 1e-5 * (xf.abs() @ (centred.abs() + zz.abs()).T) + 1e-6 + \
                    (ref.abs() * 2 ** -8 if xdt == torch.bfloat16 else 0)
                assert ((y.double() - ref).abs() <= tol).all(), (fmt, n, k, gs, rows, xdt)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("int8_act", [False, True])
def test_non_finite_activations_reach_the_output(isa, fmt, int8_act):
    """A NaN or inf in a row's activations makes that row's outputs non-finite, as a float matmul would (rounding
    activations to int16 or int8 must not turn it into a finite number), and leaves the other rows alone."""
    lib = K.load(isa)
    p, _ = _weights(lib, 37, 100, fmt, int8_act=int8_act)
    for bad in (float("nan"), float("inf")):
        for rows in (1, 2, 5):
            x = torch.randn(rows, 100)
            x[0, 40] = bad
            y = p(x)
            assert not torch.isfinite(y[0]).any() and torch.isfinite(y[1:]).all(), (isa, fmt, int8_act, bad, rows)


@pytest.mark.parametrize("isa", ISAS)
def test_a_rows_result_does_not_depend_on_the_batch(isa):
    """Streaming (few rows) and widened-panel (many rows) paths do the same arithmetic: bitwise equal rows; the
    int8-activation kernels quantize each row on its own and re-read blocks from cache for further rows."""
    torch.manual_seed(1)
    lib = K.load(isa)
    x = torch.randn(64, 300)
    for fmt, int8_act in [("fp32", False), ("bf16", False), ("int8", False), ("int4", False), ("int8", True),
                          ("int4", True)]:
        p, _ = _weights(lib, 67, 300, fmt, torch.randn(67), int8_act)
        for xs in (x, x.bfloat16()):  # int4 with bf16 activations: the vdpbf16ps kernel where the CPU has it
            full = p(xs)
            ones = torch.cat([p(xs[i:i + 1]) for i in range(64)])
            twos = torch.cat([p(xs[i:i + 2]) for i in range(0, 64, 2)])
            threes = torch.cat([p(xs[i:i + 3]) for i in range(0, 64, 3)])
            assert torch.equal(full, ones) and torch.equal(full, twos) and torch.equal(full, threes), \
                (isa, fmt, int8_act, xs.dtype)


@pytest.mark.skipif("avx512_bf16" not in cpu_flags(), reason="this CPU has no AVX512-BF16 (vdpbf16ps)")
@pytest.mark.parametrize("isa", [isa for isa in ISAS if isa.startswith("avx512")])
@pytest.mark.parametrize("gs", [32, 64, 128])
def test_int4_times_bf16_by_vdpbf16ps(isa, gs, monkeypatch):
    """csrc/int4_bf16dot.h: bf16 activations against the float64 product (its magic-number form, 0x4300 | q =
    128 + q, cancels 136 s * sum(x): still within fp32 rounding of sum|x||w|), the float kernel's results within
    the output's bf16 rounding, chosen for bf16 activations only, and off with LLMRT_INT4_BF16DOT=0."""
    torch.manual_seed(5)
    lib = K.load(isa)
    assert lib.linear_int4_bf16dot is not None
    # (20, 2048): blocks 4 KiB apart, where one row takes bd_tile<1> instead of the 4-block tile
    for n, k in SHAPES + [(256, 1000), (20, 2048)]:
        kp = k + (-k % gs)
        q, sc, z = quantize_int4(F.pad(torch.randn(n, k), (0, kp - k)), gs)
        sz = torch.stack([sc, z], -1).bfloat16().double()
        dense = ((q.double().view(n, -1, gs) - 8) * sz[..., 0][..., None] + sz[..., 1][..., None]).view(n, kp)[:, :k]
        bias = torch.randn(n)
        p = dataclasses.replace(PackedLinear.int4(lib, q, sc, z, gs, k, bias), batch="")
        assert p.bf16dot
        for rows in (1, 3, 4, 9):
            x = torch.randn(rows, k).bfloat16()
            ref = x.double() @ dense.T + bias.double()
            y = p(x)
            assert y.dtype == torch.bfloat16
            scale = 1e-5 * (x.double().abs() @ dense.abs().T) + 1e-6
            assert ((y.double() - ref).abs() <= scale + ref.abs() * 2 ** -8).all(), (isa, gs, n, k, rows)
            # the float kernel on the same bf16 x: the fp32 sums differ in order only, then one bf16 rounding each
            old = lib.linear_int4(x, p.data, p.sz, gs, n, p.bias).double()
            assert ((y.double() - old).abs() <= 2 * scale + 2 ** -7 * torch.maximum(y.double().abs(), old.abs())).all()
    monkeypatch.setenv("LLMRT_INT4_BF16DOT", "0")
    assert not PackedLinear.int4(lib, q, sc, z, gs, k).bf16dot


HAS_AMX = K.has_amx("avx512", cpu_flags())
HAS_BF16_DOT = K.has_bf16_dot("avx512", cpu_flags())
# Each batched kernel needs its CPU feature; on AMX CPUs the vdpbf16ps panels are tested with LLMRT_AMX=0.
BATCH_ROUTES = [
    pytest.param("amx", marks=pytest.mark.skipif(not HAS_AMX, reason="this CPU has no AMX-BF16 tiles")),
    pytest.param("bf16gemm", marks=pytest.mark.skipif(not HAS_BF16_DOT, reason="this CPU has no AVX512-BF16"))]


@pytest.mark.parametrize("route", BATCH_ROUTES)
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_int8_int4_batch_kernels(route, fmt, monkeypatch):
    """csrc/amx.h (AMX tiles) and csrc/bf16_gemm.h (vdpbf16ps panels, the choice where AMX is missing or off): bf16
    steps of their rows against the float64 product (the weights rounded to bf16 once, as the dequantize + GEMM
    path rounded them: 2^-8 of sum|x||w|, plus the output's bf16 rounding), a row's result the same within any
    batch it runs in, only bf16 steps of their rows taken, and off with their switch (LLMRT_AMX, LLMRT_BF16_GEMM)."""
    from llmrt.kernels.packed import batch_rows

    if route == "bf16gemm":
        monkeypatch.setenv("LLMRT_AMX", "0")
    torch.manual_seed(6)
    lib = K.load("avx512vnni" if "avx512vnni" in ISAS else "avx512")
    lo, hi = batch_rows(route, fmt)
    hi = int(min(hi, 600))  # bf16gemm has no upper limit: 600 rows take several activation blocks per thread
    for n, k in SHAPES + [(4096, 768), (70, 2048)]:
        bias = torch.randn(n).bfloat16()
        p, dense = _weights(lib, n, k, fmt, bias, batched=True)
        assert p.batch == route
        x = torch.randn(hi, k).bfloat16()
        for rows in (lo, lo + 1, 17, 33, hi):
            assert p.on_batch_kernel(x[:rows]) and not p.on_batch_kernel(x[:rows].float())
            ref = x[:rows].double() @ dense.T + bias.double()
            y = p(x[:rows])
            assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
            tol = (2 ** -8 + 1e-5) * (x[:rows].double().abs() @ dense.abs().T) + 1e-6 + \
                2 ** -8 * torch.maximum(ref.abs(), y.double().abs())
            assert ((y.double() - ref).abs() <= tol).all(), (fmt, n, k, rows)
        full = p(x)
        parts = [p(x[i:i + lo]) for i in range(0, hi - hi % lo, lo)]
        assert torch.equal(full[:hi - hi % lo], torch.cat(parts)), (fmt, n, k)
        assert not p.on_batch_kernel(x[:lo - 1])
        assert p.on_batch_kernel(torch.cat([x, x])) == (route == "bf16gemm")  # AMX stops at AMX_ROWS[1]
        assert not dataclasses.replace(p, int8_act=True).on_batch_kernel(x[:lo])  # int8 activations keep theirs
    monkeypatch.setenv("LLMRT_AMX" if route == "amx" else "LLMRT_BF16_GEMM", "0")
    assert _packed(lib, 37, 100, fmt, None, False)[0].batch != route


@pytest.mark.parametrize("isa", ISAS)
def test_batch_kernels_follow_the_cpu(isa):
    """The builds offer the tile kernels only on AMX-BF16 CPUs and the panels only with AVX512-BF16; fp32/bf16
    layers never take either."""
    lib = K.load(isa)
    assert (lib.linear_int8_amx is not None) == (lib.linear_int4_amx is not None) == K.has_amx(isa, cpu_flags())
    assert (lib.linear_int8_bf16gemm is not None) == K.has_bf16_dot(isa, cpu_flags())
    no_amx = frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16"})
    assert not K.has_amx("avx512", no_amx) and K.has_amx("avx512", no_amx | {"amx_bf16", "amx_tile"})
    assert not K.has_bf16_dot("avx2", no_amx) and not K.has_bf16_dot("avx512", no_amx - {"avx512_bf16"})
    want = "amx" if lib.linear_int4_amx is not None else "bf16gemm" if lib.linear_int4_bf16gemm is not None else ""
    assert _packed(lib, 37, 100, "int4", None, False)[0].batch == want
    assert PackedLinear.dense(lib, torch.randn(8, 64)).batch == ""


@pytest.mark.parametrize("isa", ISAS)
def test_int4_layout_and_dequantize(isa):
    torch.manual_seed(2)
    q = torch.randint(0, 16, (9, 128), dtype=torch.int32)
    packed = pack_int4_chunks(q)
    assert packed.shape == (9, 64) and torch.equal(unpack_int4_chunks(packed).int(), q)
    sc, z = torch.randn(9, 2), torch.randn(9, 2)  # group 64: 2 groups of (scale, zero)
    sz = torch.stack([sc, z], -1).bfloat16().float()
    want = ((q.float().view(9, 2, 64) - 8) * sz[..., 0][..., None] + sz[..., 1][..., None]).view(9, 128)
    p = PackedLinear.int4(K.load(isa), q, sc, z, 64, 128)
    for dt in (torch.float32, torch.bfloat16):
        out = p.unpack_into(torch.empty(9, 128, dtype=dt))
        torch.testing.assert_close(out.float(), want.to(dt).float(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8"])
def test_dense_pack_round_trip(isa, fmt):
    """unpack (the large-step path) gives back exactly the weights the kernel computes with."""
    torch.manual_seed(3)
    p, dense = _weights(K.load(isa), 37, 100, fmt)
    for dt in (torch.float32, torch.bfloat16):
        out = p.unpack_into(torch.empty(37, 100, dtype=dt))
        assert torch.equal(out, dense.float().to(dt)), (fmt, dt)
    assert p.data.shape == (10, 4 * (112 if fmt == "fp32" else 128))  # rows to 4s, inputs to whole chunks


def test_builds_are_cached_by_source_and_isa():
    isa = ISAS[0]
    lib = K.load(isa)
    assert lib.path.is_file() and lib.path.parent == K.build_dir(isa) and lib.how in ("compiled", "cached")
    K.load.cache_clear()
    again = K.load(isa)
    assert again.how == "cached" and again.path == lib.path
    assert K.build_dir("avx2") != K.build_dir("avx512")


def test_kernel_isa_from_the_capability_table():
    assert kernel_isa(frozenset({"avx2", "fma"})) == "avx2"
    assert kernel_isa(frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"})) == "avx512"
    assert kernel_isa(frozenset({"avx", "sse4_2"})) is None
    avx512 = frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"})
    assert K.build_for(avx512) == "avx512" and K.build_for(avx512 | {"avx512_vnni"}) == "avx512vnni"
    assert K.build_for(frozenset({"avx2", "fma", "avx_vnni"})) == "avx2"  # AVX-VNNI: vpmaddubsw for now


def _linears(llm: LLM) -> list[Linear]:
    model = llm.engine.executor.worker.model_runner.model
    return [m for m in model.modules() if isinstance(m, Linear)]


@pytest.fixture
def kernels_env(monkeypatch):
    """Set LLMRT_KERNELS for one engine build; the choice is re-read (and restored after)."""
    def set_to(value: str) -> None:
        monkeypatch.setenv("LLMRT_KERNELS", value)
        K.kernels.cache_clear()

    yield set_to
    monkeypatch.delenv("LLMRT_KERNELS", raising=False)
    K.kernels.cache_clear()


@pytest.mark.parametrize("quant,dtype", [(None, "bfloat16"), (None, "float32"), ("int8", "float32"),
                                         ("int4", "float32")])
def test_layers_use_the_kernels_and_match_torchs_paths(quant, dtype, kernels_env, embedded_model_dir):
    """The same model with the kernels and with LLMRT_KERNELS=0 (torch's paths): same greedy story."""
    params = SamplingParams(max_tokens=16, temperature=0)
    out = {}
    for choice in ("auto", "0"):
        kernels_env(choice)
        llm = LLM(dtype=dtype, quantization=quant)
        layers = _linears(llm)
        chosen = [m for m in layers if m.kernels is not None]
        if choice == "0":
            assert not chosen
        elif quant == "int4":  # ours where torch's packed int4 kernel does not apply (N % 16 != 0), torch's elsewhere
            quantized = layers[:-1]
            assert chosen and all((m.kernels is not None) != m.int4_torch_packed for m in quantized)
            assert all(m.kernels is not None for m in quantized if m.out_features % 16)
        else:  # every Linear: quantized ones, and the fp32/bf16 ones (the LM head too)
            assert len(chosen) == len(layers)
        out[choice] = llm.generate(["Once upon a time"], params)[0].outputs[0].token_ids
    assert out["auto"] == out["0"]


def test_prefill_sized_steps_take_torchs_gemm_with_the_same_weights(embedded_model_dir):
    """Above kernel_max_rows int4 dequantizes our layout for the GEMM: the rows agree with the kernel's."""
    from llmrt.model.loader import load_model

    model = load_model(ModelConfig(str(embedded_model_dir), quantization="int4"), torch.device("cpu"))
    layer = next(m for m in model.modules() if isinstance(m, Linear) and m.kernels is not None)
    x = torch.randn(layer.kernel_max_rows + 5, layer.in_features)
    with torch.inference_mode():
        big = layer(x)
        small = torch.cat([layer(x[i:i + 1]) for i in range(x.shape[0])])
    block = K.int16_block(layer.kernels.isa, layer.packed.fmt)
    slack = _int16_rounding(x, layer.packed, block) if block else 0
    assert ((big - small).abs() <= 1e-4 + 1e-4 * small.abs() + slack).all()


def test_fallback_when_the_kernels_cannot_be_built(kernels_env, monkeypatch, caplog):
    def broken(isa):
        raise RuntimeError("Error building extension 'llmrt_kernels': g++ not found")

    monkeypatch.setattr(K, "load", broken)
    kernels_env("auto")
    with caplog.at_level(logging.WARNING, logger="llmrt.kernels"):
        assert K.kernels() is None and K.kernels() is None
    warnings = [r.message for r in caplog.records if "unavailable" in r.message]
    assert len(warnings) == 1 and "g++ not found" in warnings[0] and "torch's paths" in warnings[0]
    llm = LLM(quantization="int4")
    assert all(m.kernels is None for m in _linears(llm))
    assert llm.generate(["Once upon a time"], SamplingParams(max_tokens=4, temperature=0))[0].outputs[0].token_ids


def test_dense_copy_rule():
    """auto keeps the copies when they take at most 1/8 of memory; on/off are what they say."""
    from llmrt.kernels.packed import keep_dense_copy

    assert keep_dense_copy("auto", 1 << 30, 8 << 30) and not keep_dense_copy("auto", (1 << 30) + 1, 8 << 30)
    assert keep_dense_copy("on", 1 << 40, 1) and not keep_dense_copy("off", 0, 1 << 40)
    with pytest.raises(ValueError, match="auto, on, off"):
        keep_dense_copy("yes", 0, 1)
    with pytest.raises(Exception, match="dense_weight_copy"):
        LLM(dense_weight_copy="yes")


def test_bf16_upcast_layers_take_their_builds_row_limit(monkeypatch, embedded_model_dir):
    """Where bf16 is emulated, a loaded model's packed bf16 layers run the kernel up to the limit of the build that
    loaded (kernels.max_rows: 64 on AVX2, the default elsewhere), and the capability check says that number; the
    VNNI build shares the AVX-512 limits."""
    from llmrt import hardware

    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: False)
    llm = LLM(dtype="bfloat16")
    isa = K.kernels().isa
    packed = [m for m in _linears(llm) if m.packed is not None]
    assert packed and {m.kernel_max_rows for m in packed} == {K.max_rows(isa, "bf16 upcast")}
    flags = frozenset(K.ISA_NEEDS[isa])  # exactly the build's ISA, no bf16 arithmetic
    detail = hardware.format_support(torch.device("cpu"), "bfloat16", flags).detail
    assert f"up to {K.max_rows(isa, 'bf16 upcast')} rows" in detail
    assert all(K.max_rows("avx512vnni", f) == K.max_rows("avx512", f) for f in K.MAX_ROWS)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_dense_copy_serves_large_steps_with_the_same_results(dtype, embedded_model_dir, monkeypatch):
    """With the dense copy kept, steps above kernel_max_rows run torch's GEMM on it: the same outputs as the
    per-step unpack (bitwise for the plain copy, to the GEMM's rounding for oneDNN's layout), the same greedy
    tokens for a batch larger than the kernels take, and its bytes counted."""
    from llmrt.model.layers.linear import dense_copy_layers, onednn_prepack

    # 70 rows per decode step: above every format's kernel rows (kernels.max_rows)
    prompts = [f"Once upon a time {i}" for i in range(70)]
    params = SamplingParams(max_tokens=12, temperature=0)
    out, weights = {}, {}
    for setting, prepack in (("on", "0"), ("on", "1"), ("off", "1")):
        monkeypatch.setenv("LLMRT_ONEDNN_PREPACK", prepack)
        llm = LLM(dtype=dtype, dense_weight_copy=setting, max_num_seqs=80)
        layers = _linears(llm)
        packed = [m for m in layers if m.packed is not None]
        assert packed and all(m.keep_dense == (setting == "on") for m in packed)
        model = llm.engine.executor.worker.model_runner.model
        # prepacked where oneDNN computes the weights' dtype and activations arrive in it; where the CPU emulates
        # bf16 (AVX2 only) they arrive in fp32 and the bf16 copy stays plain (an fp32 one would double its bytes)
        w_dtype = getattr(torch, dtype)
        oned = setting == "on" and prepack == "1" and onednn_prepack(w_dtype) \
            and packed[0].compute_dtype in (None, w_dtype)
        assert all((m.weight_onednn is not None) == (oned and m.prepack_dense) for m in packed)
        assert all(hasattr(m, "weight") == (setting == "on" and m.weight_onednn is None) for m in packed)
        key = f"{setting}-{prepack}"
        out[key] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        weights[key] = llm.engine.memory.weights_bytes
        if setting == "on":
            assert weights[key] == llm.engine.executor.worker.model_runner.weights_bytes()
            extra = dense_copy_layers(model)[1]
            layer = next(m for m in packed if m.prepack_dense)
            x_dtype = layer.compute_dtype or getattr(torch, dtype)
            x = torch.randn(layer.kernel_max_rows + 40, layer.in_features).to(x_dtype)
            with torch.inference_mode():
                dense = layer(x)
                keep, oned_w = layer.keep_dense, layer.weight_onednn
                layer.keep_dense, layer.weight_onednn = False, None  # the same layer through the unpacked buffer
                unpacked = layer(x)
                layer.keep_dense, layer.weight_onednn = keep, oned_w
            tol = 0 if oned_w is None else 1e-5 if x_dtype == torch.float32 else 2e-2
            torch.testing.assert_close(dense, unpacked, rtol=tol, atol=tol)
    assert out["on-0"] == out["off-1"] == out["on-1"]
    assert weights["on-0"] - weights["off-1"] == weights["on-1"] - weights["off-1"] == extra > 0


def test_a_refused_onednn_prepack_keeps_the_plain_copy(embedded_model_dir, monkeypatch, caplog):
    """Where oneDNN refuses a reorder (e.g. capped below the CPU's ISA) the layers keep their plain dense copies,
    with one warning, and generate as before."""
    def refuse(w, hint):
        raise RuntimeError("mkldnn_reorder_linear_weight: refused for the test")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    monkeypatch.setattr("llmrt.model.layers.linear._PREPACK_REFUSED", set())
    with caplog.at_level("WARNING", logger="llmrt.model.layers.linear"):
        llm = LLM(dtype="float32", dense_weight_copy="on", max_num_seqs=8)
    packed = [m for m in _linears(llm) if m.packed is not None]
    assert packed and all(m.weight_onednn is None and hasattr(m, "weight") for m in packed)
    assert len([r for r in caplog.records if "cannot prepack" in r.message]) == 1
    out = llm.generate(["Once upon a time"] * 6, SamplingParams(max_tokens=4, temperature=0))
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)
