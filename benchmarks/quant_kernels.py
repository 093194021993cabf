"""Micro-benchmark of the CPU weight-only kernels behind --quantization int8/int4, per step shape.

Run: PYTHONPATH=. python benchmarks/quant_kernels.py  (prints a Markdown table; figures go to docs/quantization.md)
Shapes: the 110m random model's largest projections (768 -> 2048 gate/up, 2048 -> 768 down).
"""
from __future__ import annotations

import os
import time

import torch

from llmrt.bench.report import load_average, machine_info


def best_ms(fn, rounds: int = 9, iters: int = 10) -> float:
    """Best-of-rounds mean milliseconds per call."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - t) / iters * 1e3)
    return best


def main() -> None:
    torch.manual_seed(0)
    if os.environ.get("THREADS"):
        torch.set_num_threads(int(os.environ["THREADS"]))
    rows_list = [1, 64]
    shapes = [(2048, 768), (768, 2048)]
    print(machine_info(), "load", load_average())
    print("| N x K | rows | fp32 | bf16 | int8pack bf16 act | int8pack fp32 act | int4pack bf16 act (g32) | "
          "int4pack fp32 act | dequant int8->fp32 + fp32 mm |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n, k in shapes:
        w = torch.randn(n, k)
        wb = w.bfloat16()
        scale = w.abs().amax(1) / 127
        q8 = torch.round(w / scale[:, None]).clamp(-128, 127).to(torch.int8)
        gs = 32
        wg = w.view(n, k // gs, gs)
        mn, mx = wg.amin(-1), wg.amax(-1)
        sc4 = ((mx - mn) / 15).clamp(min=1e-8)
        zero = mn + 8 * sc4  # tinygemm: w = (q - 8) * scale + zero
        q4 = torch.round((wg - mn[..., None]) / sc4[..., None]).clamp(0, 15).to(torch.int32).view(n, k)
        packed = torch._convert_weight_to_int4pack_for_cpu(q4, 1) if hasattr(torch, "_convert_weight_to_int4pack_for_cpu") else None
        sz = torch.stack([sc4, zero], -1).transpose(0, 1).contiguous()  # [k/gs, n, 2]
        for rows in rows_list:
            x = torch.randn(rows, k)
            xb = x.bfloat16()
            r = {
                "fp32": best_ms(lambda: torch.nn.functional.linear(x, w)),
                "bf16": best_ms(lambda: torch.nn.functional.linear(xb, wb)),
                "i8b": best_ms(lambda: torch._weight_int8pack_mm(xb, q8, scale.bfloat16())),
                "i8f": best_ms(lambda: torch._weight_int8pack_mm(x, q8, scale)),
                "deq": best_ms(lambda: torch.nn.functional.linear(x, q8.float() * scale[:, None])),
            }
            if packed is not None:
                r["i4b"] = best_ms(lambda: torch._weight_int4pack_mm_for_cpu(xb, packed, gs, sz.bfloat16()))
                r["i4f"] = best_ms(lambda: torch._weight_int4pack_mm_for_cpu(x, packed, gs, sz))
            print(f"| {n}x{k} | {rows} | {r['fp32']:.3f} | {r['bf16']:.3f} | {r['i8b']:.3f} | {r['i8f']:.3f} | "
                  f"{r.get('i4b', float('nan')):.3f} | {r.get('i4f', float('nan')):.3f} | {r['deq']:.3f} |")
    print("load", load_average(), "threads", torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS"))


if __name__ == "__main__":
    main()
