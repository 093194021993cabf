"""The int8/int4 x bf16 panel kernels (csrc/bf16_gemm.h) against the kernel sources at a git revision, in one process.

The sources at `--baseline` are compiled under their own op namespace (llmrt_<isa>_base) beside this tree's build;
the 124.7M Llama's 48 decoder-layer linears (distinct weights per layer, so streamed from memory as a step reads
them) are called with bf16 activations at each row count, the two builds alternating within each round, oneDNN's
prepacked bf16 GEMM on the same shapes alongside; best of rounds.

Run: PYTHONPATH=. python benchmarks/bf16_gemm_ab.py --baseline REV [--rounds 5] [--rows 64 256 2048]
"""
from __future__ import annotations

import argparse
import time

import torch

from llmrt.bench.report import load_average, machine_info
from llmrt.kernels import kernels
from llmrt.kernels.packed import PackedLinear
from llmrt.model.quantization.int4 import quantize_int4
from llmrt.model.quantization.int8 import quantize_int8

from gemv_bandwidth import baseline_ops  # benchmarks/, the script's own folder

SHAPES = [(1280, 768), (768, 768), (4096, 768), (768, 2048)] * 12


def main() -> None:
    """Alternate oneDNN, the baseline build and this tree's per row count; print the best times and ratios."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", required=True, help="git revision of the kernel sources to compare against")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", type=int, nargs="*", default=[16, 64, 256, 512, 2048])
    ap.add_argument("--formats", nargs="*", default=["int4", "int8"])
    args = ap.parse_args()
    lib = kernels()
    assert lib is not None and lib.linear_int4_bf16gemm is not None, "needs llmrt's kernels on an AVX512-BF16 CPU"
    base = baseline_ops(args.baseline, lib.isa)
    dense = [torch.randn(n, k) * 0.02 for n, k in SHAPES]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 64) for w in dense]
    packed = {"int4": [PackedLinear.int4(lib, *quantize_int4(w, 32), 32, w.shape[1]) for w in dense],
              "int8": [PackedLinear.dense(lib, q, None, s) for q, s in map(quantize_int8, dense)]}

    def call(ops, fmt: str, p: PackedLinear, x: torch.Tensor) -> None:
        if fmt == "int4":
            ops.linear_int4_bf16gemm(x, p.data, p.sz, 32, p.n, None)
        else:
            ops.linear_int8_bf16gemm(x, p.data, p.scale, p.n, None)

    print(f"{machine_info()}, load {load_average():.1f}; ms for the 48 linears, best of {args.rounds}")
    for rows in args.rows:
        xs = {k: torch.randn(rows, k).bfloat16() for k in (768, 2048)}
        best: dict[str, float] = {}
        for _ in range(args.rounds):
            t = time.perf_counter()
            for (_, k), w in zip(SHAPES, onednn):
                torch.ops.mkldnn._linear_pointwise(xs[k], w, None, "none", [], "")
            best["oneDNN"] = min(best.get("oneDNN", 1e9), time.perf_counter() - t)
            for fmt in args.formats:
                for name, ops in (("base", base), ("new", lib)):
                    t = time.perf_counter()
                    for p in packed[fmt]:
                        call(ops, fmt, p, xs[p.k])
                    key = f"{fmt} {name}"
                    best[key] = min(best.get(key, 1e9), time.perf_counter() - t)
        line = " ".join(f"{k} {v * 1e3:.2f}" for k, v in best.items())
        ratios = " ".join(f"{fmt} new/base {best[f'{fmt} new'] / best[f'{fmt} base']:.3f} new/oneDNN "
                          f"{best[f'{fmt} new'] / best['oneDNN']:.3f}" for fmt in args.formats)
        print(f"rows {rows}: {line} | {ratios}", flush=True)


if __name__ == "__main__":
    main()
