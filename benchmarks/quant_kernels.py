"""Micro-benchmark of the CPU linear kernels behind bf16, --quantization int8 and int4, per layer shape and rows.

Cache-hot (the same weights every call; benchmarks/gemv_bandwidth.py measures cold-cache bandwidth). Compares
llmrt's own kernels (llmrt/kernels, weights packed as the linear methods pack them) with torch's paths on the 110m model's layer shapes (hidden 768,
FFN 2048, 4 KV heads, vocab 32000) for 1..64 rows. Methods alternate within every round; best of rounds.

Run: PYTHONPATH=. python benchmarks/quant_kernels.py [--rounds 25] [--isa avx2]
  -> benchmarks/linear-kernels[-ISA].json + .md (milliseconds per call)
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from llmrt.bench.report import load_average, machine_info, now_iso
from llmrt.hardware import describe_device, kernel_isa
from llmrt.kernels import load
from llmrt.kernels.packed import PackedLinear
from llmrt.model.quantization.int4 import quantize_int4
from llmrt.model.quantization.int8 import quantize_int8

SHAPES = {"qkv 1280x768": (1280, 768), "o 768x768": (768, 768), "gate_up 4096x768": (4096, 768),
          "down 768x2048": (768, 2048), "lm_head 32000x768": (32000, 768)}
ROWS = (1, 2, 4, 8, 16, 64)


def timed(fn: Callable[[], object], iters: int) -> float:
    """Mean milliseconds per call over `iters` calls."""
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) / iters * 1e3


def methods(n: int, k: int, rows: int, lib) -> dict[str, Callable[[], object]]:
    """Every way to compute this shape: torch's (fp32, bf16, packed int8/int4, dequantize) and ours."""
    w = torch.randn(n, k)
    wb = w.bfloat16()
    x, xb = torch.randn(rows, k), torch.randn(rows, k).bfloat16()
    q8, s8 = quantize_int8(w)
    s8b = s8.bfloat16()
    q4, sc, z = quantize_int4(w, 32)
    packed_t = torch._convert_weight_to_int4pack_for_cpu(q4, 1)
    sz_t = torch.stack([sc, z], -1).transpose(0, 1).contiguous().bfloat16()
    pb, p8, p4 = (PackedLinear.dense(lib, wb), PackedLinear.dense(lib, q8, scale=s8),
                  PackedLinear.int4(lib, q4, sc, z, 32, k))
    deq = torch.empty(n, k)
    return {
        "torch fp32": lambda: F.linear(x, w),
        "torch bf16": lambda: F.linear(xb, wb),
        "ours bf16 (fp32 x)": lambda: pb(x),
        "ours bf16 (bf16 x)": lambda: pb(xb),
        "torch int8pack": lambda: torch._weight_int8pack_mm(xb, q8, s8b),
        "torch int8 dequant+fp32": lambda: F.linear(x, torch.mul(q8, s8[:, None], out=deq)),
        "ours int8": lambda: p8(x),
        "torch int4pack g32": lambda: torch._weight_int4pack_mm_for_cpu(xb, packed_t, 32, sz_t),
        "ours int4 g32": lambda: p4(x),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--isa", default=kernel_isa())
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    args = ap.parse_args()
    torch.manual_seed(0)
    lib = load(args.isa)
    loads = [load_average()]
    table: dict[str, dict[int, dict[str, float]]] = {}
    for shape in args.shapes:
        n, k = SHAPES[shape]
        for rows in ROWS:
            ms = methods(n, k, rows, lib)
            # Short rounds, many of them: on a shared machine a round that a context switch hit is discarded.
            iters = max(1, int(1e7 // (n * k)))
            best = {name: float("inf") for name in ms}
            for fn in ms.values():
                fn()
            for _ in range(args.rounds):
                for name, fn in ms.items():
                    best[name] = min(best[name], timed(fn, iters))
            table.setdefault(shape, {})[rows] = best
            print(shape, rows, " ".join(f"{k_}={v:.3f}" for k_, v in best.items()), flush=True)
        loads.append(load_average())
    result = {"date": now_iso(), "machine": machine_info(), "isa": describe_device(torch.device("cpu")),
              "kernels": args.isa, "threads": torch.get_num_threads(), "rounds": args.rounds,
              "load_average": loads, "ms_per_call": table}
    suffix = "" if args.isa == kernel_isa() else f"-{args.isa}"
    out = Path("benchmarks")
    (out / f"linear-kernels{suffix}.json").write_text(json.dumps(result, indent=2) + "\n")
    names = list(next(iter(next(iter(table.values())).values())))
    lines = [f"# linear kernels ({args.isa} build)", "",
             f"{result['date']}, {result['machine']['cpu']}, {result['isa']}, torch {result['machine']['torch']}, "
             f"{result['threads']} threads, best of {args.rounds} alternating rounds, load average "
             f"{loads[0]} -> {loads[-1]}. Milliseconds per call (lower is better); `x` = activation dtype.", "",
             "| shape | rows | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for shape, by_rows in table.items():
        for rows, best in by_rows.items():
            lo = min(best.values())
            cells = [f"**{v:.3f}**" if v == lo else f"{v:.3f}" for v in best.values()]
            lines.append(f"| {shape} | {rows} | " + " | ".join(cells) + " |")
    (out / f"linear-kernels{suffix}.md").write_text("\n".join(lines) + "\n")
    print("load average", loads)


if __name__ == "__main__":
    main()
