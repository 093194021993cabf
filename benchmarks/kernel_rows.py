"""Where llmrt's fp32 and bf16 linear kernels stop paying against torch's GEMM, per rows, with the weights cold.

A real decode step reads each layer's weights once and then moves on, so this streams 12 layers' distinct weights
(the 110m model's qkv/o/gate_up/down shapes) in turn and sums the 48 calls; methods alternate within each round,
best of rounds. Compared: ours on fp32 and bf16 packed weights; torch's GEMM on the dense fp32 weight; and, where
the CPU has no bf16 arithmetic, torch's fp32 GEMM over a bf16 weight upcast into one reused buffer (what
UnquantizedLinearMethod does above the kernels' rows). A warm variant (one layer called again and again) is
misleading here: torch's GEMM then wins above 16 fp32 rows on AVX2, while with cold weights ours stays ahead to 64.

Run: PYTHONPATH=. python benchmarks/kernel_rows.py [--rounds 6] -> benchmarks/kernel-rows-<isa>.{json,md}
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from llmrt.bench.report import load_average, machine_info, now_iso
from llmrt.kernels import kernels
from llmrt.kernels.packed import PackedLinear

SHAPES = [(1280, 768), (768, 768), (4096, 768), (768, 2048)] * 12
ROWS = (8, 16, 32, 48, 64)
METHODS = ("ours fp32", "torch fp32 (dense)", "ours bf16", "torch fp32 over bf16 upcast")


def best_of_rounds(methods: Sequence[str], row_counts: Sequence[int], rounds: int,
                   run: Callable[[str, int], float]) -> dict[int, dict[str, float]]:
    """{rows: {method: best ms}}: the methods alternate within each round, best of `rounds` (printed per rows)."""
    table = {}
    for rows in row_counts:
        best = {m: float("inf") for m in methods}
        for _ in range(rounds):
            for m in methods:
                best[m] = min(best[m], run(m, rows))
        table[rows] = best
        print(rows, {m: round(v, 2) for m, v in best.items()}, flush=True)
    return table


def main() -> None:
    """Time every method at every row count; write JSON and a markdown table."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    lib = kernels()
    assert lib is not None, "llmrt's kernels did not load"
    dense = [torch.randn(n, k) * 0.02 for n, k in SHAPES]
    narrow = [w.bfloat16() for w in dense]
    ours32 = [PackedLinear.dense(lib, w) for w in dense]
    ours16 = [PackedLinear.dense(lib, w) for w in narrow]
    buf = torch.empty(max(n * k for n, k in SHAPES))

    def run(method: str, rows: int) -> float:
        xs = {k: torch.randn(rows, k) for k in (768, 2048)}
        t = time.perf_counter()
        for i, (n, k) in enumerate(SHAPES):
            x = xs[k]
            if method == "ours fp32":
                ours32[i](x)
            elif method == "torch fp32 (dense)":
                F.linear(x, dense[i])
            elif method == "ours bf16":
                ours16[i](x)
            else:
                F.linear(x, buf[: n * k].view(n, k).copy_(narrow[i]))
        return (time.perf_counter() - t) * 1e3

    load0 = load_average()
    table = best_of_rounds(METHODS, ROWS, args.rounds, run)
    res = {"date": now_iso(), "machine": machine_info(), "isa": lib.isa, "threads": torch.get_num_threads(),
           "load_average": [load0, load_average()], "rounds": args.rounds, "ms_per_48_linears": table}
    out = Path(__file__).parent / f"kernel-rows-{lib.isa}"
    out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    lines = [f"# Kernel rows, {lib.isa}, {torch.get_num_threads()} threads, weights cold ({res['date']}, load "
             f"{load0} -> {res['load_average'][1]})", "", "ms for the 110m model's 48 layer linears, best of "
             f"{args.rounds} rounds", "", "| rows | " + " | ".join(METHODS) + " |",
             "| --- |" + " --- |" * len(METHODS)]
    lines += [f"| {r} | " + " | ".join(f"{table[r][m]:.2f}" for m in METHODS) + " |" for r in ROWS]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
