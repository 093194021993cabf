"""Fused CPU layer ops (csrc/fused_ops.cpp): residual-add + RMSNorm, rotary in place on q/k, SiLU-and-mul, and the
greedy sampler's argmax.

A decode step of a small model spends as long in the small ops around the GEMMs (a norm is six torch ops and
their temporaries) as in the GEMMs' memory traffic; these kernels do each in one pass. The source is compiled once
per ISA (the capability table's `kernel_isa`, the same flags as the linear kernels) into
`$LLMRT_CACHE_DIR/kernels` (llmrt/kernels/build.py); later processes only load the .so. The torch path in each
layer stays the reference and the fallback: CUDA tensors, no compiler, `--deterministic` (the layers' `fused`
flag), and `LLMRT_FUSED=0`. `LLMRT_FUSED=avx2|avx512` forces a build the CPU supports (tests compare both).
"""
from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from llmrt.hardware import cpu_flags, kernel_isa
from llmrt.kernels import ISA_FLAGS, ISA_NEEDS
from llmrt.kernels.build import load_or_compile

logger = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "csrc" / "fused_ops.cpp"


@dataclass(frozen=True)
class FusedOps:
    """One loaded build of the fused ops (torch ops in the namespace llmrt_fused_<isa>)."""

    isa: str
    path: Path
    rms_norm: Callable[..., torch.Tensor]  # (x [rows, dim], weight, eps) -> new tensor
    add_rms_norm_: Callable[..., None]  # (x, residual, weight, eps): residual += x; x = norm(residual)
    rotary_: Callable[..., None]  # (q, k, positions, cos, sin): in place
    silu_mul: Callable[..., torch.Tensor]  # (gate_up [rows, 2I]) -> [rows, I]
    argmax: Callable[..., torch.Tensor]  # (logits [rows, vocab]) -> int64 [rows], as torch.argmax(logits, -1)


def _cflags(isa: str) -> list[str]:
    # No -ffast-math and no FMA contraction: a*b - c*d rounds like torch's separate ops.
    return ["-O3", "-fopenmp", "-ffp-contract=off", f"-DLLMRT_FUSED_NS=llmrt_fused_{isa}", *ISA_FLAGS.get(isa, [])]

VEC_LANES = Path(__file__).parents[2] / "kernels" / "csrc" / "vec_lanes.h"  # SOURCE includes it: in the build key


@functools.lru_cache(maxsize=None)
def load(isa: str) -> FusedOps:
    """`isa`'s build ("avx512", "avx2" or "generic"), from the cache or compiled into it. Raises if it cannot be."""
    missing = [f for f in ISA_NEEDS.get(isa, ()) if f not in cpu_flags()]
    if missing:
        raise RuntimeError(f"this CPU lacks {', '.join(missing)} for the {isa} build of the fused ops")
    b = load_or_compile("kernels", f"llmrt_fused_{isa}", [SOURCE], _cflags(isa), [VEC_LANES])
    ns = getattr(torch.ops, f"llmrt_fused_{isa}")
    logger.info("fused layer ops (%s) %s in %.2f s: %s", isa, "loaded from cache" if b.how == "cached"
                else "compiled", b.seconds, b.path)
    return FusedOps(isa, b.path, ns.rms_norm.default, ns.add_rms_norm_.default, ns.rotary_.default,
                    ns.silu_mul.default, ns.argmax.default)


@functools.lru_cache(maxsize=None)
def fused_ops() -> Optional[FusedOps]:
    """The build this process uses, or None (the reason logged once) when off or unbuildable."""
    choice = os.environ.get("LLMRT_FUSED", "auto").lower()
    if choice in ("0", "off", "none"):
        logger.info("fused layer ops off (LLMRT_FUSED=%s): layers use torch's ops", choice)
        return None
    isa = (kernel_isa() or "generic") if choice == "auto" else choice
    if isa not in ISA_FLAGS and isa != "generic":
        raise ValueError(f"LLMRT_FUSED={choice!r}: expected auto, 0, generic, {' or '.join(ISA_FLAGS)}")
    try:
        return load(isa)
    except Exception as e:  # no compiler, no ninja, a build error: the torch path still works
        logger.warning("fused layer ops unavailable (%s: %s); layers use torch's ops", type(e).__name__,
                       (str(e).strip().splitlines() or [""])[-1])
        return None


def ops_for(x: torch.Tensor, enabled: bool) -> Optional[FusedOps]:
    """The fused ops for a layer whose `fused` flag is `enabled`, given its input x; None: use the torch path."""
    if not enabled or x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return None
    return fused_ops()


def set_fused(model: nn.Module, enabled: bool) -> int:
    """Set the `fused` flag of every layer of `model` that has one (False: torch's ops); how many were set."""
    count = 0
    for module in model.modules():
        if hasattr(module, "fused"):
            module.fused = enabled
            count += 1
    return count
