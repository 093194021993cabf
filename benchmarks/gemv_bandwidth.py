"""Cold-cache GEMV bandwidth of llmrt's linear kernels: GB/s of weight bytes per layer shape, old build vs new.

Decode streams every weight of the model once per step (200 MB for the 124.7M peers model in bf16), far more
than the L3 cache, so each timed call here reads a different copy of the weights out of a set larger than the
cache (>= --working-set MiB): the figure is what a decode step sees, not a cache-hot loop. The baseline is the
kernel source at git revision --baseline, compiled under its own op namespace so both load in one process;
the two alternate within every round, best of rounds.

Run: PYTHONPATH=. python benchmarks/gemv_bandwidth.py [--baseline main] [--rounds 9] [--rows 1 4]
  -> benchmarks/gemv-bandwidth.json + .md
"""
from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from llmrt.bench.report import load_average, machine_info, now_iso
from llmrt.hardware import describe_device, kernel_isa
from llmrt.kernels import ISA_FLAGS, KernelLib, build, load
from llmrt.model.quantization.int4 import quantize_int4
from llmrt.model.quantization.int8 import quantize_int8

SHAPES = {"qkv 768->1280": (1280, 768), "o 768->768": (768, 768), "gate_up 768->4096": (4096, 768),
          "down 2048->768": (768, 2048), "lm_head 768->32000": (32000, 768)}
FORMATS = ("bf16", "fp32", "int8", "int4")


def baseline_ops(rev: str, isa: str):
    """torch.ops namespace of the kernel sources at git `rev` (every file of llmrt/kernels/csrc there), built as
    llmrt_<isa>_base (the build cache's hash covers the sources, so each revision compiles once)."""
    d = Path(tempfile.mkdtemp(prefix="llmrt-kernels-base-"))
    names = subprocess.run(["git", "ls-tree", "--name-only", rev, "llmrt/kernels/csrc/"], check=True,
                           capture_output=True, text=True).stdout.split()
    for path in names:
        src = subprocess.run(["git", "show", f"{rev}:{path}"], check=True, capture_output=True, text=True).stdout
        (d / Path(path).name).write_text(src)
    ns = f"llmrt_{isa}_base"
    flags = ["-O3", "-fopenmp", f"-DLLMRT_NS={ns}", *ISA_FLAGS[isa]]
    build.load_or_compile("kernels-baseline", f"llmrt_kernels_{isa}_base", [d / "linear.cpp"], flags,
                          sorted(d.glob("*.h")))
    return getattr(torch.ops, ns)


def quantized(fmt: str, w: torch.Tensor) -> tuple:
    """The format's tensors for `w` (quantized once per shape: copies clone them)."""
    if fmt == "bf16":
        return (w.bfloat16(),)
    if fmt == "fp32":
        return (w,)
    if fmt == "int8":
        return quantize_int8(w)
    return quantize_int4(w, 32)


def base_calls(ops, fmt: str, t: tuple) -> tuple[Callable, int]:
    """(fn(x), weight bytes) for the baseline's API (weights in the checkpoint's [out, in] layout)."""
    t = tuple(x.clone() for x in t)
    if fmt in ("bf16", "fp32"):
        fn = ops.linear_bf16 if fmt == "bf16" else ops.linear_fp32
        return (lambda x: fn(x, t[0], None)), t[0].numel() * t[0].element_size()
    if fmt == "int8":
        return (lambda x: ops.linear_int8(x, t[0], t[1], None)), t[0].numel() + t[1].numel() * 4
    from llmrt.model.quantization.int4 import pack_int4_chunks

    p, sz = pack_int4_chunks(t[0]), torch.stack([t[1], t[2]], -1).bfloat16().contiguous()
    return (lambda x: ops.linear_int4(x, p, sz, 32, None)), p.numel() + sz.numel() * 2


def new_calls(lib: KernelLib, fmt: str, t: tuple) -> tuple[Callable, int]:
    """(fn(x), weight bytes) for this tree's kernels, weights packed the way the linear methods pack them."""
    from llmrt.kernels.packed import PackedLinear

    if fmt == "int4":
        pw = PackedLinear.int4(lib, *t, 32, t[0].shape[1])
    else:
        pw = PackedLinear.dense(lib, t[0], scale=t[1] if fmt == "int8" else None)
    return pw, pw.nbytes


def copies(make: Callable[[tuple], tuple[Callable, int]], t: tuple, mib: int) -> tuple[list, int]:
    """Enough independent weight copies that cycling through them overflows the caches."""
    fns, total, one = [], 0, 0
    while total < mib << 20:
        fn, one = make(t)
        fns.append(fn)
        total += one
    return fns, one


def timed_round(fns: list, x: torch.Tensor, calls: int) -> float:
    """Seconds per call over `calls` calls, each on the next weight copy."""
    t = time.perf_counter()
    for i in range(calls):
        fns[i % len(fns)](x)
    return (time.perf_counter() - t) / calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", default="main", help="git revision of the old kernel sources")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 4])
    ap.add_argument("--formats", nargs="*", default=list(FORMATS))
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--working-set", type=int, default=96, help="MiB of weight copies per shape and format")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--out", default="benchmarks/gemv-bandwidth")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    isa = kernel_isa()
    base, lib = baseline_ops(args.baseline, isa), load(isa)
    loads = [load_average()]
    rows_out = []
    for fmt in args.formats:
        for shape in args.shapes:
            n, k = SHAPES[shape]
            t = quantized(fmt, torch.randn(n, k) * 0.05)
            sets = {"old": copies(lambda t: base_calls(base, fmt, t), t, args.working_set),
                    "new": copies(lambda t: new_calls(lib, fmt, t), t, args.working_set)}
            for rows in args.rows:
                x = torch.randn(rows, k)
                x = x.bfloat16() if fmt == "bf16" else x
                best = {name: float("inf") for name in sets}
                calls = max(len(s[0]) for s in sets.values()) * 2
                for name, (fns, _) in sets.items():
                    timed_round(fns, x, len(fns))
                for _ in range(args.rounds):
                    for name, (fns, _) in sets.items():
                        best[name] = min(best[name], timed_round(fns, x, calls))
                gbps = {name: sets[name][1] / best[name] / 1e9 for name in sets}
                row = {"format": fmt, "shape": shape, "rows": rows, "us_old": best["old"] * 1e6,
                       "us_new": best["new"] * 1e6, "GBps_old": gbps["old"], "GBps_new": gbps["new"],
                       "speedup": best["old"] / best["new"]}
                rows_out.append(row)
                print(f"{fmt:5} {shape:20} rows={rows:2} old {row['us_old']:8.1f} us {gbps['old']:5.1f} GB/s | "
                      f"new {row['us_new']:8.1f} us {gbps['new']:5.1f} GB/s | x{row['speedup']:.2f}", flush=True)
            del sets
        loads.append(load_average())
    result = {"date": now_iso(), "machine": machine_info(), "isa": describe_device(torch.device("cpu")),
              "kernels": isa, "threads": torch.get_num_threads(), "baseline": args.baseline,
              "working_set_MiB": args.working_set, "rounds": args.rounds, "load_average": loads, "results": rows_out}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# GEMV bandwidth, cold cache ({isa} build): {args.baseline} vs this tree", "",
             f"{result['date']}, {result['machine']['cpu']}, {result['isa']}, torch {result['machine']['torch']}, "
             f"{result['threads']} threads, best of {args.rounds} alternating rounds, each call on a different copy "
             f"of the weights out of >= {args.working_set} MiB; load average {loads[0]} -> {loads[-1]}. "
             "GB/s = weight bytes (scales included) / time per call.", "",
             "| format | shape | rows | old us | new us | old GB/s | new GB/s | speed-up |", "|---|---|---|---|---|---|---|---|"]
    for r in rows_out:
        lines.append(f"| {r['format']} | {r['shape']} | {r['rows']} | {r['us_old']:.1f} | {r['us_new']:.1f} | "
                     f"{r['GBps_old']:.1f} | {r['GBps_new']:.1f} | {r['speedup']:.2f}x |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("load average", loads)


if __name__ == "__main__":
    main()
