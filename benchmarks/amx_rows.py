"""int8/int4 linears on AMX tiles against what they replace, per rows, with the weights cold (issue 16).

Streams the 124.7M peers model's 48 decoder linears (distinct weights per layer, read in turn as a step reads
them) at each row count and sums the calls; methods alternate within each round, best of rounds. Compared, all
with bf16 activations: bf16 weights in oneDNN's prepacked layout (what a bf16 model runs above 3 rows); int8 and
int4 g32 as they ran before the AMX kernel (llmrt's vector kernel up to its row limit, above it dequantize into one
reused bf16 buffer + torch's GEMM); and the AMX kernel (csrc/amx.h) on the same packed weights.

Run: PYTHONPATH=. python benchmarks/amx_rows.py [--rounds 5] -> benchmarks/amx-rows.{json,md}
"""
from __future__ import annotations

import argparse
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
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 512)
METHODS = ("bf16 oneDNN prepacked", "int8 before", "int8 AMX", "int4 before", "int4 AMX")


def main() -> None:
    """Time every method at every row count; write JSON and a markdown table."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", type=int, nargs="*", default=list(ROWS))
    args = ap.parse_args()
    lib = kernels()
    assert lib is not None and lib.linear_int4_amx is not None, "needs llmrt's kernels on an AMX CPU"
    dense = [torch.randn(n, k) * 0.02 for n, k in SHAPES]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 64) for w in dense]
    int8 = [PackedLinear.dense(lib, q, None, s) for q, s in map(quantize_int8, dense)]
    int4 = [PackedLinear.int4(lib, *quantize_int4(w, 32), 32, w.shape[1]) for w in dense]
    for p in int8 + int4:
        p.amx = False  # "before": the vector kernel or dequantize + GEMM, never the tile kernel
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
                before(int8[i], x)
            elif method == "int4 before":
                before(int4[i], x)
            elif method == "int8 AMX":
                lib.linear_int8_amx(x, int8[i].data, int8[i].scale, int8[i].n, None)
            else:
                lib.linear_int4_amx(x, int4[i].data, int4[i].sz, 32, int4[i].n, None)
        return (time.perf_counter() - t) * 1e3

    load0 = load_average()
    table = best_of_rounds(METHODS, args.rows, args.rounds, run)
    res = {"date": now_iso(), "machine": machine_info(), "isa": lib.isa, "threads": torch.get_num_threads(),
           "load_average": [load0, load_average()], "rounds": args.rounds, "row_limits_before": limits,
           "ms_per_48_linears": table}
    out = Path(__file__).parent / "amx-rows"
    out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    lines = [f"# int8/int4 on AMX tiles, {torch.get_num_threads()} threads, weights cold ({res['date']}, "
             f"{res['machine'].get('cpu', '')}, load {load0} -> {res['load_average'][1]})", "",
             f"ms for the 124.7M model's 48 decoder linears, bf16 activations, best of {args.rounds} rounds; "
             f"'before' = vector kernel up to {limits} rows, else dequantize + torch GEMM", "",
             "| rows | " + " | ".join(METHODS) + " |", "| --- |" + " --- |" * len(METHODS)]
    lines += [f"| {r} | " + " | ".join(f"{table[r][m]:.2f}" for m in METHODS) + " |" for r in args.rows]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
