"""The batched int8/int4 x bf16 kernels against what they replace, per rows, with the weights cold (issue 16).

Streams the 124.7M peers model's 48 decoder linears (distinct weights per layer, read in turn as a step reads
them) at each row count and sums the calls; methods alternate within each round, best of rounds. Compared, all
with bf16 activations: bf16 weights in oneDNN's prepacked layout (what a bf16 model runs above 3 rows); int8 and
int4 g32 as they run without a batched kernel (llmrt's vector kernel up to its row limit, above it dequantize into
one reused bf16 buffer + torch's GEMM); and the batched kernel this CPU has on the same packed weights: AMX tiles
(csrc/amx.h) or, on AVX512-BF16 CPUs without AMX, vdpbf16ps from bf16 panels (csrc/bf16_gemm.h), at every row
count (whatever AMX_ROWS / BF16_GEMM_MIN_ROWS say, which these figures choose).

Run: PYTHONPATH=. python benchmarks/batch_rows.py [--rounds 5] -> benchmarks/batch-rows-{amx,bf16gemm}.{json,md}
(earlier AMX runs: benchmarks/amx-rows.{json,md})
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from llmrt.bench.report import load_average, machine_info, now_iso
from llmrt.kernels import kernels, max_rows
from llmrt.kernels.packed import PackedLinear
from llmrt.model.quantization.int4 import quantize_int4
from llmrt.model.quantization.int8 import quantize_int8

from kernel_rows import best_of_rounds  # benchmarks/, the script's own folder

SHAPES = [(1280, 768), (768, 768), (4096, 768), (768, 2048)] * 12
ROWS = (1, 2, 4, 5, 8, 9, 16, 32, 64, 128, 256, 512, 1024)



def main() -> None:
    """Time every method at every row count; write JSON and a markdown table."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", type=int, nargs="*", default=list(ROWS))
    args = ap.parse_args()
    lib = kernels()
    route = "amx" if lib is not None and lib.linear_int4_amx is not None else "bf16gemm"
    assert lib is not None and getattr(lib, f"linear_int4_{route}") is not None, \
        "needs llmrt's kernels on a CPU with AMX or AVX512-BF16"
    label = {"amx": "AMX", "bf16gemm": "bf16 GEMM"}[route]
    methods = ("bf16 oneDNN prepacked", "int8 before", f"int8 {label}", "int4 before", f"int4 {label}")
    ops = {"int8": getattr(lib, f"linear_int8_{route}"), "int4": getattr(lib, f"linear_int4_{route}")}
    dense = [torch.randn(n, k) * 0.02 for n, k in SHAPES]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 64) for w in dense]
    int8 = [PackedLinear.dense(lib, q, None, s) for q, s in map(quantize_int8, dense)]
    int4 = [PackedLinear.int4(lib, *quantize_int4(w, 32), 32, w.shape[1]) for w in dense]
    # "before": the vector kernel or dequantize + GEMM, never a batched kernel (which the ops are called as directly)
    before_int8 = [dataclasses.replace(p, batch="") for p in int8]
    before_int4 = [dataclasses.replace(p, batch="") for p in int4]
    buf = torch.empty(max(n * k for n, k in SHAPES), dtype=torch.bfloat16)
    limits = {"int8": max_rows(lib.isa, "int8"), "int4": max_rows(lib.isa, "int4")}

    def before(p: PackedLinear, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= limits[p.fmt]:
            return p(x)
        return F.linear(x, p.unpack_into(buf[: p.n * p.padded_in].view(p.n, p.padded_in)))

    def run(method: str, rows: int) -> float:
        xs = {k: torch.randn(rows, k).bfloat16() for k in (768, 2048)}
        t = time.perf_counter()
        for i, (_, k) in enumerate(SHAPES):
            x = xs[k]
            if method == "bf16 oneDNN prepacked":
                torch.ops.mkldnn._linear_pointwise(x, onednn[i], None, "none", [], "")
            elif method == "int8 before":
                before(before_int8[i], x)
            elif method == "int4 before":
                before(before_int4[i], x)
            elif method.startswith("int8"):
                ops["int8"](x, int8[i].data, int8[i].scale, int8[i].n, None)
            else:
                ops["int4"](x, int4[i].data, int4[i].sz, 32, int4[i].n, None)
        return (time.perf_counter() - t) * 1e3

    load0 = load_average()
    table = best_of_rounds(methods, args.rows, args.rounds, run)
    res = {"date": now_iso(), "machine": machine_info(), "isa": lib.isa, "threads": torch.get_num_threads(),
           "load_average": [load0, load_average()], "rounds": args.rounds, "row_limits_before": limits,
           "ms_per_48_linears": table}
    out = Path(__file__).parent / f"batch-rows-{route}"
    out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    lines = [f"# int8/int4 x bf16 batches ({label}), {torch.get_num_threads()} threads, weights cold ({res['date']}, "
             f"{res['machine'].get('cpu', '')}, load {load0} -> {res['load_average'][1]})", "",
             f"ms for the 124.7M model's 48 decoder linears, bf16 activations, best of {args.rounds} rounds; "
             f"'before' = vector kernel up to {limits} rows, else dequantize + torch GEMM", "",
             "| rows | " + " | ".join(methods) + " |", "| --- |" + " --- |" * len(methods)]
    lines += [f"| {r} | " + " | ".join(f"{table[r][m]:.2f}" for m in methods) + " |" for r in args.rows]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
