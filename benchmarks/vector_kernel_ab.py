"""llmrt's vector kernels (linear_int4 / linear_int8 / linear_bf16 / linear_fp32 in csrc/linear.cpp) against the
kernel sources at a git revision, in one process, on any ISA.

The sources at `--baseline` are compiled under their own op namespace (llmrt_<isa>_base) beside this tree's build;
the 124.7M Llama's 48 decoder-layer linears (distinct weights per layer, so streamed from memory as a decode step
reads them) are called at each row count, the two builds alternating within each round; best of rounds. With
`--hot`, the first four layers are called twelve times instead (weights from the L3 cache: the kernels' compute
rate without the memory stream). `--isa avx2` measures another build than the one this CPU would use, and
`--dequantized` adds, from 8 rows, the weights dequantized into a reused buffer + torch's `F.linear` (what a layer
runs above its row limit).

Run: PYTHONPATH=. python benchmarks/vector_kernel_ab.py --baseline REV [--formats int4 int8] [--rows 1 2 4 16 64]
         [--dtype float32] [--isa avx2] [--dequantized]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import llmrt.kernels as K
from llmrt.bench.report import load_average, machine_info
from llmrt.kernels import kernels
from llmrt.kernels.packed import PackedLinear
from llmrt.model.quantization.int4 import quantize_int4
from llmrt.model.quantization.int8 import quantize_int8

from gemv_bandwidth import baseline_ops  # benchmarks/, the script's own folder

SHAPES = [(1280, 768), (768, 768), (4096, 768), (768, 2048)] * 12


def packed(lib, fmt: str, w: torch.Tensor) -> PackedLinear:
    """`w` in format `fmt`, packed as the linear methods pack it."""
    if fmt == "int4":
        return PackedLinear.int4(lib, *quantize_int4(w, 32), 32, w.shape[1])
    if fmt == "int8":
        q, s = quantize_int8(w)
        return PackedLinear.dense(lib, q, None, s)
    return PackedLinear.dense(lib, w.bfloat16() if fmt == "bf16" else w)


def call(ops, p: PackedLinear, x: torch.Tensor) -> None:
    """The layer's vector kernel from build `ops` (never the batched or integer-activation ones)."""
    if p.fmt == "int4":
        ops.linear_int4(x, p.data, p.sz, p.group_size, p.n, None)
    elif p.fmt == "int8":
        ops.linear_int8(x, p.data, p.scale, p.n, None)
    else:
        getattr(ops, f"linear_{p.fmt}")(x, p.data, p.n, None)


def main() -> None:
    """Alternate the baseline build and this tree's per format and row count; print best times and ratios."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", required=True, help="git revision of the kernel sources to compare against")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 2, 4, 16, 64])
    ap.add_argument("--formats", nargs="*", default=["int4", "int8"])
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="activations")
    ap.add_argument("--hot", action="store_true", help="four layers' weights repeated (cache-resident)")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--isa", default=None, help="a build other than this CPU's own (e.g. avx2)")
    ap.add_argument("--dequantized", action="store_true", help="also dequantize + F.linear from 8 rows")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lib = K.load(args.isa) if args.isa else kernels()
    assert lib is not None, "needs llmrt's kernels (x86-64 with AVX2 or AVX-512)"
    base = baseline_ops(args.baseline, lib.isa)
    torch.manual_seed(0)
    dense = [torch.randn(n, k) * 0.02 for n, k in (SHAPES[:4] if args.hot else SHAPES)]
    print(f"{machine_info()}, build {lib.isa}, {torch.get_num_threads()} threads, load {load_average():.1f}; "
          f"ms for the 48 linears ({'hot' if args.hot else 'cold'}), {args.dtype} activations, best of "
          f"{args.rounds} alternating rounds", flush=True)
    for fmt in args.formats:
        layers = [packed(lib, fmt, w) for w in dense] * (12 if args.hot else 1)
        bufs: dict[tuple[int, int], torch.Tensor] = {}
        for rows in args.rows:
            xs = {k: torch.randn(rows, k).to(getattr(torch, args.dtype)) for k in (768, 2048)}
            best = {"base": 1e9, "new": 1e9, "dequantized": 1e9}
            dequantized = args.dequantized and rows >= 8
            for r in range(args.rounds):
                order = (("base", base), ("new", lib)) if r % 2 == 0 else (("new", lib), ("base", base))
                for name, ops in order + ((("dequantized", None),) if dequantized else ()):
                    t = time.perf_counter()
                    for p in layers:
                        if ops is None:
                            buf = bufs.setdefault((p.n, p.k), torch.empty(p.n, p.padded_in, dtype=xs[p.k].dtype))
                            F.linear(xs[p.k], p.unpack_into(buf)[:, :p.k])
                        else:
                            call(ops, p, xs[p.k])
                    best[name] = min(best[name], time.perf_counter() - t)
            extra = f" {best['dequantized'] * 1e3:.2f} |" if dequantized else ""
            print(f"| {fmt} | {rows} | {best['base'] * 1e3:.2f} | {best['new'] * 1e3:.2f} | "
                  f"{best['new'] / best['base']:.3f}x |{extra}", flush=True)
    print(f"load {load_average():.1f}")


if __name__ == "__main__":
    main()
