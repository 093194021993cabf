"""Weights in the layout of llmrt's linear kernels, packed once at load, and the calls that use them.

Layout (linear.cpp says why): output rows in blocks of 4, each row cut into chunks of KC inputs (32; 16 for
fp32, so a chunk is at most 64 bytes), block b stored as chunk 0 of rows 4b..4b+3, then chunk 1 of the same
rows, ... Rows are padded to a multiple of 4 and inputs to a whole chunk (int4: a whole group) with zeros, so
the kernel has no tails. int4 chunks keep `pack_int4_chunks`'s byte order (16 bytes per row and chunk) and
their (scale, zero) pairs are interleaved the same way per group.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.nn.functional as F

from llmrt.kernels import amx_enabled, bf16_gemm_enabled, hugepages, int4_bf16dot, int8_activations

if TYPE_CHECKING:
    from llmrt.kernels import KernelLib

NB = 4  # rows per block (linear.cpp's NB)
DENSE_COPY_SETTINGS = ("auto", "on", "off")
# auto keeps the dense copies when together they take at most this share of the device's memory (a 124.7M bf16
# model: 0.25 GB of 24 GiB, kept; a 7B bf16 model: 13 GB, dropped).
DENSE_COPY_MAX_SHARE = 1 / 8
KC = {torch.float32: 16, torch.bfloat16: 32, torch.int8: 32}
# Rows of a bf16 step that int8/int4 layers run on AMX tiles (csrc/amx.h), where the CPU has them. Measured with
# benchmarks/batch_rows.py (the 124.7M model's 48 decoder linears, 2 threads, Xeon with AMX; benchmarks/amx-rows.md,
# ms, tiles vs before, two runs at different minutes): from 8 rows the tiles are faster (int4 8 rows 8.0-10.9 vs
# 14.0-25.6, 16 rows 7.8-10.4 vs 26-32, 64 rows 13.2-21.0 vs 23.8-41.0; int8 8 rows 9.1-11.4 vs 12.1-15.8, 64 rows
# 14.3-23.5 vs 24.4-36.3), at 4 they tie with the vector kernels and below lose (1 row int4 7.4-12.3 vs 4.0-5.8: a
# panel's dequantization costs the same whatever the rows); at 128 rows they still win (int4 23-36 vs 27-46) and at
# 512 lose to dequantize + oneDNN's GEMM (75-111 vs 53-54: the panel loop streams all activations per 64 weight
# rows, with no cache blocking).
AMX_ROWS = (8, 128)
# Rows from which a bf16 step of an int8/int4 layer runs by vdpbf16ps from bf16 panels (csrc/bf16_gemm.h) on
# AVX512-BF16 CPUs without AMX. Measured with benchmarks/batch_rows.py (the 124.7M model's 48 decoder linears, 2
# threads, AMD EPYC with AVX512-BF16, 2026-12-06; benchmarks/batch-rows-bf16gemm.md): from 5 rows int8 was faster
# than its float vector kernel, from 9 int4 (at 8 they tie). Since int8's vector kernel is the int16 one on these
# (VNNI) CPUs (csrc/int8_i16dot.h, 2026-12-07, the same 48 linears): it takes 0.60-0.80x the panels' time at 5-8
# rows, 0.98x at 9-10, 1.08x at 11, 1.16x at 12, so int8 panels start at 11. There is no upper limit: against
# dequantize + oneDNN's GEMM it is faster up to 512 rows and level at 1024-2048 (within 0.6%) where that path runs
# at its best, and 1.1-1.2x faster where it does not (it is bimodal per process on this host).
BF16_GEMM_MIN_ROWS = {"int8": 11, "int4": 9}
BATCH_KERNELS = ("amx", "bf16gemm")  # in order of preference; csrc/amx.h, csrc/bf16_gemm.h


def batch_kernel(lib: "KernelLib", fmt: str) -> str:
    """The batched int8/int4 x bf16 kernel layers of `fmt` run ("amx" or "bf16gemm"), "" for none: the first that
    this CPU's build has and its switch allows (LLMRT_AMX, LLMRT_BF16_GEMM)."""
    enabled = {"amx": amx_enabled, "bf16gemm": bf16_gemm_enabled}
    for name in BATCH_KERNELS:
        if fmt in ("int8", "int4") and getattr(lib, f"linear_{fmt}_{name}") is not None and enabled[name]():
            return name
    return ""


def batch_rows(kernel: str, fmt: str) -> tuple[int, float]:
    """The bf16 step rows (lowest, highest) that `kernel` takes for layers of `fmt`."""
    return AMX_ROWS if kernel == "amx" else (BF16_GEMM_MIN_ROWS[fmt], float("inf"))


def _interleave(t: torch.Tensor, chunk: int) -> torch.Tensor:
    """[Np, Kp] (Np % 4 == 0, Kp % chunk == 0) -> [Np/4, Kp*4] in block-chunk order, in huge pages (hugepages.py)."""
    n, k = t.shape
    out = hugepages.empty((n // NB, NB * k), t.dtype)
    out.view(n // NB, k // chunk, NB, chunk).copy_(t.view(n // NB, NB, k // chunk, chunk).permute(0, 2, 1, 3))
    return out


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    rows = -t.shape[0] % NB
    # F.pad copies even when it adds nothing: two whole-model copies at load (0.58 s of a 1.2 s fp32 124.7M load)
    return F.pad(t, (0,) * (2 * t.dim() - 1) + (rows,)) if rows else t


def pack_dense(w: torch.Tensor) -> torch.Tensor:
    """fp32, bf16 or int8 [N, K] -> the kernels' packed [ceil(N/4), 4*Kp]."""
    chunk = KC[w.dtype]
    cols = -w.shape[1] % chunk
    w = _pad_rows(w)
    return _interleave(F.pad(w, (0, cols)) if cols else w, chunk)


def pack_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_int4's (q [N, Kp], scale, zero [N, Kp/g]), Kp a multiple of the group (itself of 32) ->
    (packed uint8 [ceil(N/4), 2*Kp], (scale, zero) bf16 [ceil(N/4), G, 4, 2])."""
    from llmrt.model.quantization.int4 import pack_int4_chunks

    nibbles = _interleave(_pad_rows(pack_int4_chunks(q)), 16)
    sz = _pad_rows(torch.stack([scale, zero], dim=-1).bfloat16())  # [Np, G, 2]
    np_, g = sz.shape[:2]
    return nibbles, hugepages.copy_of(sz.view(np_ // NB, NB, g, 2).permute(0, 2, 1, 3))


def packed_bytes(fmt: str, n: int, k: int, group_size: int = 32) -> int:
    """Bytes an [n, k] weight takes packed (padding, int8 scales, int4 scales and zeros included): the plan's
    count of what PackedLinear holds."""
    n4 = -(-n // NB) * NB
    if fmt == "int4":
        kp = -(-k // group_size) * group_size
        return n4 * (kp // 2 + kp // group_size * 4)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}[fmt]
    kp = -(-k // KC[dtype]) * KC[dtype]
    return n4 * kp * dtype.itemsize + (n4 * 4 if fmt == "int8" else 0)


def keep_dense_copy(setting: str, copy_bytes: int, memory_total: int) -> bool:
    """Whether fp32/bf16 layers packed for the kernels also keep their dense [out, in] weights (`copy_bytes` in
    all) for steps larger than the kernels take: torch's GEMM then reads them in place instead of unpacking every
    layer on every such step (W1: batched decode and prefill). `setting` is --dense-weight-copy."""
    if setting not in DENSE_COPY_SETTINGS:
        raise ValueError(f"dense weight copy must be one of {', '.join(DENSE_COPY_SETTINGS)}, got {setting!r}")
    if setting != "auto":
        return setting == "on"
    return copy_bytes <= memory_total * DENSE_COPY_MAX_SHARE


@dataclass(frozen=True)  # frozen: the batched kernel's op and rows follow `batch` (dataclasses.replace)
class PackedLinear:
    """One layer's weights in the kernels' layout with what its calls need: out/in sizes, int8 row scales,
    int4 group (scale, zero) pairs, and the bias as float32 (converted once here, not per call)."""

    lib: "KernelLib"
    fmt: str  # "fp32" | "bf16" | "int8" | "int4"
    n: int
    k: int
    data: torch.Tensor
    scale: Optional[torch.Tensor] = None
    sz: Optional[torch.Tensor] = None
    group_size: int = 0
    bias: Optional[torch.Tensor] = None
    # int8/int4: quantize activations to int8 per block of 32 and use integer dot products (LLMRT_INT8_ACTIVATIONS)
    int8_act: bool = False
    # int4 with bf16 activations: the vdpbf16ps kernel (AVX512-BF16 CPUs; LLMRT_INT4_BF16DOT), unless int8_act
    bf16dot: bool = False
    # int8/int4: the batched kernel for bf16 steps of several rows, `batch_kernel`'s choice ("" for none);
    # on_batch_kernel says which calls take it
    batch: str = ""
    _batch_rows: tuple[int, float] = field(init=False, repr=False)
    _batch_op: Optional[Callable[..., torch.Tensor]] = field(init=False, repr=False)

    def __post_init__(self) -> None:  # the batched kernel's rows and op, looked up once (calls are per step)
        object.__setattr__(self, "_batch_rows", batch_rows(self.batch, self.fmt) if self.batch else (1, 0))
        object.__setattr__(self, "_batch_op", getattr(self.lib, f"linear_{self.fmt}_{self.batch}") if self.batch
                           else None)

    @classmethod
    def dense(cls, lib: "KernelLib", w: torch.Tensor, bias: Optional[torch.Tensor] = None,
              scale: Optional[torch.Tensor] = None) -> "PackedLinear":
        """fp32/bf16 weights, or int8 ones with their float32 row scales."""
        fmt = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.int8: "int8"}[w.dtype]
        if scale is not None:
            scale = _pad_rows(scale.float()).contiguous()
        return cls(lib, fmt, w.shape[0], w.shape[1], pack_dense(w), scale=scale, bias=_bias(bias),
                   int8_act=fmt == "int8" and int8_activations(), batch=batch_kernel(lib, fmt))

    @classmethod
    def int4(cls, lib: "KernelLib", q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
             in_features: int, bias: Optional[torch.Tensor] = None) -> "PackedLinear":
        """quantize_int4's output (inputs padded to the group) for a layer of `in_features` inputs."""
        data, sz = pack_int4(q, scale, zero)
        return cls(lib, "int4", q.shape[0], in_features, data, sz=sz, group_size=group_size, bias=_bias(bias),
                   int8_act=int8_activations(), bf16dot=lib.linear_int4_bf16dot is not None and int4_bf16dot(),
                   batch=batch_kernel(lib, "int4"))

    @property
    def padded_in(self) -> int:
        """Inputs including the zero padding (activations are padded to it by the kernel)."""
        return self.data.shape[1] * (2 if self.fmt == "int4" else 1) // NB

    @property
    def nbytes(self) -> int:
        """Bytes the kernel streams per call (weights, scales)."""
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.sz) if t is not None)

    def on_batch_kernel(self, x: torch.Tensor) -> bool:
        """Whether this call runs the layer's batched kernel: a 2-D bf16 step of `batch_rows` rows, unless its
        activations are quantized to int8 (LLMRT_INT8_ACTIVATIONS)."""
        lo, hi = self._batch_rows
        return lo <= x.shape[0] <= hi and x.dtype == torch.bfloat16 and x.dim() == 2 and not self.int8_act

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """y = x W^T + b for a 2-D float32/bfloat16 x (y in x's dtype)."""
        lib, b = self.lib, self.bias
        if self.on_batch_kernel(x):
            x = x if x.stride(-1) == 1 else x.contiguous()
            if self.fmt == "int4":
                return self._batch_op(x, self.data, self.sz, self.group_size, self.n, b)
            return self._batch_op(x, self.data, self.scale, self.n, b)
        if self.fmt == "int4":
            if self.bf16dot and not self.int8_act and x.dtype == torch.bfloat16:
                return lib.linear_int4_bf16dot(x, self.data, self.sz, self.group_size, self.n, b)
            fn4 = lib.linear_int4_q8 if self.int8_act else lib.linear_int4
            return fn4(x, self.data, self.sz, self.group_size, self.n, b)
        if self.fmt == "int8":
            return (lib.linear_int8_q8 if self.int8_act else lib.linear_int8)(x, self.data, self.scale, self.n, b)
        return (lib.linear_fp32 if self.fmt == "fp32" else lib.linear_bf16)(x, self.data, self.n, b)

    def unpack_into(self, out: torch.Tensor) -> torch.Tensor:
        """The dense [N, K] weights (int8: times their scales; int4: dequantized, K padded to the group) written
        into `out` (float32 or bfloat16, e.g. a shared upcast buffer), for steps torch's GEMM runs."""
        if self.fmt == "int4":
            self.lib.dequantize_int4(self.data, self.sz, self.group_size, out)
        else:
            self.lib.unpack(self.data, self.scale, out)
        return out


def _bias(bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if bias is None else bias.detach().float().contiguous()
