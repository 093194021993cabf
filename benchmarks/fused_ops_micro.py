"""Each fused CPU layer op against the layer's torch path, per call, 1 thread, alternating, best of rounds.

Shapes of the peers' 124.7M Llama (hidden 768, 12 heads / 4 KV heads of 64, intermediate 2048) at 1, 64 and 2048
rows (a W2 decode, a W1 decode, a full prefill chunk). Prints and writes microseconds per call.

usage: python fused_ops_micro.py [--rounds 3] [--out FILE]
"""
import argparse
import json
import os
import time

import torch

from llmrt.model.layers.activation import GatedActivation
from llmrt.model.layers.fused import fused_ops
from llmrt.model.layers.norms import RMSNorm
from llmrt.model.layers.rotary import RotaryEmbedding

ap = argparse.ArgumentParser()
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--out")
args = ap.parse_args()


def main() -> None:
    """Time torch vs fused for norm (with residual), rotary and SiLU-and-mul; print and write the JSON."""
    assert fused_ops() is not None, "the fused ops did not load"
    torch.set_num_threads(1)
    out = {"isa": fused_ops().isa, "load_start": os.getloadavg(), "date": time.ctime(), "us_per_call": {}}
    rope = RotaryEmbedding(64, 1024, {"rope_theta": 10000.0, "rope_type": "default"})
    for dtype in (torch.bfloat16, torch.float32):
        for rows in (1, 64, 2048):
            norm, act = RMSNorm(768).to(dtype), GatedActivation("silu")
            h, r = torch.randn(rows, 768).to(dtype), torch.randn(rows, 768).to(dtype)
            gu = torch.randn(rows, 4096).to(dtype)
            qkv = torch.randn(rows, 20 * 64).to(dtype)
            pos = torch.arange(rows) % 1024

            def run_norm():
                norm(h.clone(), r.clone())

            def run_act():
                act(gu)

            def run_rope():
                q, k, _ = qkv.clone().split([768, 256, 256], dim=-1)
                rope(pos, q.view(rows, 12, 64), k.view(rows, 4, 64))
            best: dict[str, float] = {}
            n = 3 if rows == 2048 else 50
            for _ in range(args.rounds):
                for side in ("torch", "fused"):
                    for m in (norm, act, rope):
                        m.fused = side == "fused"
                    for name, f in (("add_rms_norm", run_norm), ("silu_mul", run_act), ("rotary", run_rope)):
                        t = time.perf_counter()
                        for _ in range(n):
                            f()
                        key = f"{name} {side}"
                        best[key] = min(best.get(key, 1e18), (time.perf_counter() - t) / n * 1e6)
            out["us_per_call"][f"{str(dtype)[6:]} {rows} rows"] = {k: round(v, 1) for k, v in best.items()}
            print(dtype, rows, out["us_per_call"][f"{str(dtype)[6:]} {rows} rows"], flush=True)
    out["load_end"] = os.getloadavg()
    if args.out:
        json.dump(out, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
