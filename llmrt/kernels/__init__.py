"""llmrt's own CPU matmul kernels (llmrt/kernels/csrc), compiled once per source and ISA and loaded as torch ops.

The C++ sources are JIT-compiled with `torch.utils.cpp_extension.load` into a cache directory keyed by a hash of
the sources, the ISA build flags and the torch version (`$LLMRT_CACHE_DIR/kernels` or `~/.cache/llmrt/kernels`),
so a process pays the compile once per machine (`make install` pre-builds it) and later ones only load the .so.
The ISA comes from the capability table (`hardware.kernel_isa`). Where the compiler or the ISA is missing, or
`LLMRT_KERNELS=0`, `kernels()` returns None (logged once, with the reason) and the linear methods keep torch's
own paths. `LLMRT_KERNELS=avx2|avx512` forces a build the CPU supports (tests compare both).
"""
from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from llmrt.hardware import cpu_flags, kernel_isa
from llmrt.kernels import build

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCE = CSRC / "linear.cpp"  # includes simd.h
ISA_FLAGS = {
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c",
               "-DLLMRT_AVX512"],
    # the avx512 build plus VNNI's vpdpbusd for the int8-activation int8/int4 kernels (qdot.h); without VNNI
    # the avx512 build computes the same integer dot products with vpmaddubsw + vpmaddwd
    "avx512vnni": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mavx2", "-mfma",
                   "-mf16c", "-DLLMRT_AVX512", "-DLLMRT_VNNI"],
}
# Steps of up to this many rows run our kernel; larger ones torch's GEMM over the weights unpacked from our layout
# into one reused buffer (int8/int4 dequantized). Chosen from benchmarks/linear-kernels.md (110m layer shapes) and
# an idle rerun on an AVX-512-BF16 CPU (docs/performance.md): with the old row-major kernels, ours matched torch's
# native bf16 at 1-4 rows and was 1.7x slower at 8. Since weights are packed, torch's path also pays the unpack
# (one read and write of the layer), and the packed kernel is 1.5-2x faster: at 8 rows on gate_up (1 thread,
# load 7) ours 0.46 ms vs torch 0.37 + unpack 0.32 ms, at 64 rows ours 12.3 vs 3.8 + 0.5 -> bf16 up to 8.
# "bf16 upcast": bf16 weights on a CPU without bf16 arithmetic (activations fp32), where torch's path is an fp32
# GEMM over an upcast copy. fp32 (idle, summed over the same shapes, old kernels): ours 3.5 vs torch's 9.3 ms at
# 1 row, 6.2 vs 18.3 at 8, 19.8 vs 41.9 at 64. int8/int4: ours matched or beat dequantize+GEMM up to 64 rows.
MAX_ROWS = {"fp32": 64, "bf16": 8, "bf16 upcast": 16, "int8": 64, "int4": 64}
# Where a build's own measurements moved a limit (benchmarks/kernel_rows.py: weights cold, 12 layers' distinct
# copies read in turn as a step reads them, the 110m model's 48 layer linears summed, 2 threads). AVX2 (AMD EPYC
# without AVX-512, load < 1, benchmarks/kernel-rows-avx2.md): "bf16 upcast" ours against the fp32 GEMM over an upcast
# copy, 16 rows 38.2 vs 96.1 ms, 32 rows 47.7 vs 121.8, 64 rows 111.9 vs 154.9. fp32 ours stays level with or ahead
# of torch's GEMM on the dense copy up to 64 rows (131.5 vs 132.6 at 64); with warm weights (one layer called again
# and again) torch's won above 16 fp32 rows, which is not what a step sees.
# AVX-512 (AMD EPYC with AVX512-BF16, 2026-12-05; 124.7M model's 48 layer linears, weights streamed, 2 threads, bf16
# activations): int8/int4 ours against dequantizing into the shared buffer + torch's GEMM, ms: int8 12 rows 15.1 vs
# 15.8, 16 rows 18.1 vs 17.2, 64 rows 56.2 vs 33.0; int4 g32 16 rows 16.2 vs 17.1, 24 rows 23.3 vs 19.8, 64 rows
# 60.7 vs 33.0 (ours widens to fp32 and is FMA-bound from ~16 rows; torch's bf16 GEMM runs vdpbf16ps).
# int4 on AVX-512 took those 16 rows while its kernel widened the nibbles to fp32; with int16 activations (int_i16.h,
# as on AVX2) it keeps the common 64 (Zen 4 EPYC, the same 48 linears, fp32 activations: 32 rows 31.8 vs 58.7 ms
# dequantized + torch's GEMM, 64 rows 60.9 vs 83.7, benchmarks/int4-i16-rows-avx512-2026-12-07.md; bf16 steps of
# 9+ rows take the vdpbf16ps panels before this limit applies on CPUs with AVX512-BF16).
MAX_ROWS_BY_ISA: dict[str, dict[str, int]] = {"avx2": {"bf16 upcast": 64}, "avx512": {"int8": 12}}
ISA_NEEDS = {"avx2": ("avx2", "fma"), "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
             "avx512vnni": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni")}


@dataclass
class KernelLib:
    """One loaded build of the kernels: its ISA, ops, .so path, and whether it was compiled or found cached."""

    isa: str
    path: Path
    how: str  # "compiled" | "cached"
    seconds: float
    linear_bf16: Callable[..., torch.Tensor]
    linear_fp32: Callable[..., torch.Tensor]
    linear_int8: Callable[..., torch.Tensor]
    linear_int4: Callable[..., torch.Tensor]
    unpack: Callable[..., None]
    dequantize_int4: Callable[..., None]
    linear_int8_q8: Callable[..., torch.Tensor]  # int8-quantized activations, integer dot products (qdot.h)
    linear_int4_q8: Callable[..., torch.Tensor]
    int_dot: str  # which instructions those use, e.g. "avx512-vnni vpdpbusd"
    # int4 weights times bf16 activations by vdpbf16ps (csrc/int4_bf16dot.h): AVX-512 builds on AVX512-BF16 CPUs
    linear_int4_bf16dot: Optional[Callable[..., torch.Tensor]] = None
    # int8/int4 weights times bf16 activations on AMX tiles (csrc/amx.h): AVX-512 builds on AMX-BF16 CPUs whose
    # kernel granted the process tile state
    linear_int8_amx: Optional[Callable[..., torch.Tensor]] = None
    linear_int4_amx: Optional[Callable[..., torch.Tensor]] = None
    # the same by vdpbf16ps from a bf16 panel (csrc/bf16_gemm.h): AVX-512 builds on AVX512-BF16 CPUs
    linear_int8_bf16gemm: Optional[Callable[..., torch.Tensor]] = None
    linear_int4_bf16gemm: Optional[Callable[..., torch.Tensor]] = None


def build_for(flags: frozenset[str]) -> Optional[str]:
    """The build this CPU runs: the capability table's kernel ISA, with VNNI where AVX-512 has it."""
    isa = kernel_isa(flags)
    return "avx512vnni" if isa == "avx512" and "avx512_vnni" in flags else isa


def _cflags(isa: str) -> list[str]:
    return ["-O3", "-fopenmp", f"-DLLMRT_NS=llmrt_{isa}", *ISA_FLAGS[isa]]


def build_dir(isa: str) -> Path:
    """The cache directory of `isa`'s build of the current sources (hash of csrc/, flags, torch version)."""
    return build.build_dir("kernels", f"llmrt_kernels_{isa}", sorted(CSRC.iterdir()), _cflags(isa))


def int16_block(isa: str, fmt: str) -> int:
    """The inputs per scale with which `isa`'s vector kernel for `fmt` (linear_int8, linear_int4) rounds activations
    to int16: 32 (csrc/int_i16.h: int4 in every build, int8 in AVX2's), 256 (int8 in the VNNI build,
    csrc/int8_i16dot.h), or 0 where it widens the weights to fp32 instead (int8 in the AVX-512 build without VNNI)."""
    if fmt == "int4" or isa == "avx2":
        return 32
    return 256 if isa == "avx512vnni" else 0


def has_bf16_dot(isa: str, flags: frozenset[str]) -> bool:
    """Whether `isa`'s build has the vdpbf16ps kernels (int4 x bf16 vectors, int8/int4 x bf16 panels) on a CPU with
    `flags` (AVX-512 builds, AVX512-BF16)."""
    return isa.startswith("avx512") and "avx512_bf16" in flags


def has_amx(isa: str, flags: frozenset[str]) -> bool:
    """Whether `isa`'s build runs int8/int4 x bf16 on AMX tiles on a CPU with `flags` (AVX-512 builds, AMX-BF16)."""
    return isa.startswith("avx512") and "amx_bf16" in flags and "amx_tile" in flags


def _amx_ops(isa: str, ns) -> tuple[Optional[Callable[..., torch.Tensor]], Optional[Callable[..., torch.Tensor]]]:
    if not has_amx(isa, cpu_flags()):
        return None, None
    if not hasattr(ns, "amx_ready"):  # a compiler without AMX intrinsics (GCC < 11) built it without them
        logger.info("llmrt kernels (%s) built without AMX: int8/int4 batches dequantize for torch's GEMM", isa)
        return None, None
    if not ns.amx_ready.default():
        logger.warning("the OS refused this process AMX tile state: int8/int4 batches dequantize for torch's GEMM")
        return None, None
    return ns.linear_int8_amx.default, ns.linear_int4_amx.default


def _ops(isa: str, path: Path, how: str, seconds: float) -> KernelLib:
    ns = getattr(torch.ops, f"llmrt_{isa}")
    bf16 = has_bf16_dot(isa, cpu_flags())
    return KernelLib(isa, path, how, seconds, ns.linear_bf16.default, ns.linear_fp32.default,
                     ns.linear_int8.default, ns.linear_int4.default, ns.unpack.default, ns.dequantize_int4.default,
                     ns.linear_int8_q8.default, ns.linear_int4_q8.default, ns.int_dot.default(),
                     ns.linear_int4_bf16dot.default if bf16 else None, *_amx_ops(isa, ns),
                     ns.linear_int8_bf16gemm.default if bf16 else None,
                     ns.linear_int4_bf16gemm.default if bf16 else None)


@functools.lru_cache(maxsize=None)
def load(isa: str) -> KernelLib:
    """`isa`'s build, loaded from the cache or compiled into it first. Raises if the compiler fails."""
    missing = [f for f in ISA_NEEDS[isa] if f not in cpu_flags()]
    if missing:
        raise RuntimeError(f"this CPU lacks {', '.join(missing)} for the {isa} kernels")
    headers = [f for f in CSRC.iterdir() if f != SOURCE]
    b = build.load_or_compile("kernels", f"llmrt_kernels_{isa}", [SOURCE], _cflags(isa), headers)
    return _ops(isa, b.path, b.how, b.seconds)


@functools.lru_cache(maxsize=None)
def kernels() -> Optional[KernelLib]:
    """The kernels this process uses, or None (the reason logged once) when they are off or cannot be built."""
    choice = os.environ.get("LLMRT_KERNELS", "auto").lower()
    if choice in ("0", "off", "none"):
        logger.info("llmrt kernels off (LLMRT_KERNELS=%s): linear layers use torch's paths", choice)
        return None
    isa = build_for(cpu_flags()) if choice == "auto" else choice
    if isa is None:
        logger.warning("llmrt kernels unavailable: this CPU has no AVX2+FMA; linear layers use torch's paths")
        return None
    if isa not in ISA_FLAGS:
        raise ValueError(f"LLMRT_KERNELS={choice!r}: expected auto, 0, {' or '.join(ISA_FLAGS)}")
    try:
        lib = load(isa)
    except Exception as e:  # no compiler, no ninja, a build error: torch's paths still work
        logger.warning("llmrt kernels unavailable (%s: %s); linear layers use torch's paths",
                       type(e).__name__, str(e).strip().splitlines()[-1] if str(e).strip() else "")
        return None
    logger.info("llmrt kernels (%s%s) %s in %.2f s: %s", lib.isa, ", AMX tiles" if lib.linear_int4_amx else "",
                "loaded from cache" if lib.how == "cached" else "compiled", lib.seconds, lib.path)
    return lib


def _switch(var: str, default: str) -> bool:
    choice = os.environ.get(var, default).lower()
    if choice not in ("0", "1", "off", "on"):
        raise ValueError(f"{var}={choice!r}: expected 1 or 0")
    return choice in ("1", "on")


def int8_activations() -> bool:
    """Whether int8/int4 layers quantize their activations to int8 (per block of 32, as llama.cpp's Q8_0) and
    use integer dot products: LLMRT_INT8_ACTIVATIONS=1, or 0 (the default: activations rounded to int16 per block,
    or fp32 against weights widened in registers, `int16_block`; the int8 scheme misses some of the
    random-model agreement bounds, docs/quantization.md)."""
    return _switch("LLMRT_INT8_ACTIVATIONS", "0")


def int4_bf16dot() -> bool:
    """Whether int4 layers given bf16 activations use the AVX512-BF16 kernel where the CPU and build have it:
    LLMRT_INT4_BF16DOT=1 (the default) or 0 (`linear_int4`: activations rounded to int16, csrc/int_i16.h)."""
    return _switch("LLMRT_INT4_BF16DOT", "1")


def amx_enabled() -> bool:
    """Whether int8/int4 layers run steps of AMX_ROWS rows with bf16 activations on AMX tiles where the CPU and
    build have them: LLMRT_AMX=1 (the default) or 0 (the vector kernels, or dequantize + torch's GEMM)."""
    return _switch("LLMRT_AMX", "1")


def bf16_gemm_enabled() -> bool:
    """Whether int8/int4 layers run steps of BF16_GEMM_MIN_ROWS rows or more with bf16 activations by vdpbf16ps
    from bf16 panels where the CPU has AVX512-BF16 and no AMX: LLMRT_BF16_GEMM=1 (the default) or 0 (as
    LLMRT_AMX=0)."""
    return _switch("LLMRT_BF16_GEMM", "1")


def max_rows(isa: str, fmt: str) -> int:
    """Up to how many rows `isa`'s build computes a layer of format `fmt` (a MAX_ROWS key)."""
    isa = "avx512" if isa.startswith("avx512") else isa
    return MAX_ROWS_BY_ISA.get(isa, {}).get(fmt, MAX_ROWS[fmt])


def for_layer(fmt: str, weight: torch.Tensor) -> tuple[Optional[KernelLib], int]:
    """(kernels, max rows) for a layer of format `fmt` (a MAX_ROWS key) whose weights are `weight`;
    (None, 0) where torch's paths compute it (not a CPU tensor, or no kernels)."""
    if weight.device.type != "cpu":
        return None, 0
    lib = kernels()
    return (lib, max_rows(lib.isa, fmt)) if lib is not None else (None, 0)
