"""int4 x bf16 kernel (csrc/int4_bf16dot.h) against the kernel sources at a git revision, in one process.

The sources at `--baseline` are compiled under their own op namespace (llmrt_<isa>_base) beside this tree's build;
the 124.7M Llama's 48 decoder-layer linears (int4 g32, distinct weights per layer, so streamed from memory as in
decode) are called with 1-16 bf16 activation rows, the two builds alternating within each round; best of rounds.

Run: PYTHONPATH=. python benchmarks/int4_bf16dot_ab.py --baseline REV [--rounds 9] -> benchmarks/int4-bf16dot-ab.md
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from llmrt.bench.report import load_average, machine_info, now_iso
from llmrt.hardware import cpu_flags
from llmrt.kernels import build_for, load
from llmrt.kernels.packed import PackedLinear
from llmrt.model.quantization.int4 import quantize_int4

from gemv_bandwidth import baseline_ops  # benchmarks/, the script's own folder

SHAPES = [(1280, 768), (768, 768), (4096, 768), (768, 2048)] * 12
ROWS = (1, 2, 4, 8, 16)


def main() -> None:
    """Alternate the two builds per row count; print and write the best times and their ratio."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", required=True, help="git revision of the kernel sources to compare against")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", default="benchmarks/int4-bf16dot-ab.md")
    args = ap.parse_args()
    isa = build_for(cpu_flags())  # the build the engine loads
    assert isa.startswith("avx512"), f"the vdpbf16ps kernel is built for AVX-512 only (this CPU: {isa})"
    base, lib = baseline_ops(args.baseline, isa), load(isa)
    assert lib.linear_int4_bf16dot is not None, "this CPU has no AVX512-BF16"
    torch.manual_seed(0)
    layers = []
    for n, k in SHAPES:
        q, s, z = quantize_int4(torch.randn(n, k) * 0.02, 32)
        layers.append(PackedLinear.int4(lib, q, s, z, 32, k))

    def run(fn, rows: int) -> float:
        xs = {k: torch.randn(rows, k).bfloat16() for k in (768, 2048)}
        t = time.perf_counter()
        for p in layers:
            fn(xs[p.k], p.data, p.sz, 32, p.n, None)
        return (time.perf_counter() - t) * 1e3

    load0 = load_average()
    lines = [f"# int4 x bf16 kernel: this tree against `{args.baseline}`", "",
             f"`benchmarks/int4_bf16dot_ab.py`, {now_iso()}, {machine_info()}, build {isa}, "
             f"{torch.get_num_threads()} threads, load {load0} -> {{load1}}; the 124.7M Llama's 48 decoder linears "
             f"(int4 g32), best of {args.rounds} alternating rounds.", "",
             "| rows | baseline ms | this tree ms | ratio |", "|---|---|---|---|"]
    for rows in ROWS:
        best = {"base": 1e9, "new": 1e9}
        for _ in range(args.rounds):
            best["base"] = min(best["base"], run(base.linear_int4_bf16dot, rows))
            best["new"] = min(best["new"], run(lib.linear_int4_bf16dot, rows))
        lines.append(f"| {rows} | {best['base']:.2f} | {best['new']:.2f} | {best['new'] / best['base']:.2f}x |")
        print(lines[-1], flush=True)
    text = "\n".join(lines).replace("{load1}", str(load_average())) + "\n"
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
