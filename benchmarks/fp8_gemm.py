"""fp8 against bf16 linear layers on CUDA, per layer shape and rows: the matmul alone and the fp8 method's whole
call (the per-token activation quantization included), timed with CUDA events, best of rounds.

Shapes: the 110m benchmark model's (hidden 768) and an 8B Llama's (hidden 4096, FFN 14336), where the weights
are large enough that reading them, not launching kernels, sets the time of a decode step.

Run: PYTHONPATH=. python benchmarks/fp8_gemm.py [--rounds 5] -> benchmarks/fp8-gemm-<gpu>.json + .md
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from llmrt.bench.report import machine_info, now_iso
from llmrt.model.layers.linear import Linear
from llmrt.model.quantization.fp8 import Fp8Config

SHAPES = {"110m gate_up 4096x768": (4096, 768), "110m lm_head 32000x768": (32000, 768),
          "8B qkv 6144x4096": (6144, 4096), "8B gate_up 28672x4096": (28672, 4096), "8B down 4096x14336": (4096, 14336)}
ROWS = (1, 16, 64, 256, 2048)


def cuda_ms(fn, iters: int) -> float:
    """Mean milliseconds per call of `fn` over `iters` calls, by CUDA events."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows_out = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        layers = {}
        for mode in ("rowwise", "tensorwise"):
            layer = Linear(k, [n], quant_config=Fp8Config(mode)).to(dev)
            layer.weight.data.copy_(w)
            layer.method.process_weights_after_loading(layer)
            layers[mode] = layer
        for m in ROWS:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            xq, xs = torch.randn(m, k, device=dev).to(torch.float8_e4m3fn), torch.ones(m, 1, device=dev)
            fns = {"bf16 F.linear": lambda: F.linear(x, w),
                   "fp8 _scaled_mm (rowwise)": lambda: torch._scaled_mm(
                       xq, layers["rowwise"].qweight, scale_a=xs, scale_b=layers["rowwise"].weight_scale,
                       out_dtype=torch.bfloat16),
                   "fp8 method (rowwise)": lambda: layers["rowwise"](x),
                   "fp8 method (tensorwise)": lambda: layers["tensorwise"](x)}
            best = {label: min(cuda_ms(fn, args.iters) for _ in range(args.rounds)) for label, fn in fns.items()}
            base = best["bf16 F.linear"]
            row = {"shape": name, "rows": m, **{f"{k} ms": round(v, 4) for k, v in best.items()},
                   **{f"{k} vs bf16": round(v / base, 3) for k, v in best.items() if k != "bf16 F.linear"},
                   "bf16 weight GB/s": round(n * k * 2 / base / 1e6, 1)}
            rows_out.append(row)
            print(json.dumps(row), flush=True)
    gpu = torch.cuda.get_device_name(dev).replace(" ", "-")
    result = {"date": now_iso(), "machine": machine_info("cuda"), "rounds": args.rounds, "iters": args.iters,
              "rows": rows_out}
    out = Path(__file__).parent / f"fp8-gemm-{gpu}"
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    cols = ["shape", "rows", "bf16 F.linear ms", "fp8 _scaled_mm (rowwise) vs bf16", "fp8 method (rowwise) vs bf16",
            "fp8 method (tensorwise) vs bf16", "bf16 weight GB/s"]
    lines = [f"fp8 vs bf16 linear layers on {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, "
             f"{result['date']}; best of {args.rounds} rounds of {args.iters} calls (CUDA events).", "",
             "| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows_out]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
