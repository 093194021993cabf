"""llmrt's offline `LLM` on the peers' workloads, written like bench_vllm.py: W1 = all 64 token prompts in one
generate call, W2 = one request, TTFT from the call to its first token, TPOT = (t_last - t_first) / 127.

usage: python bench_llmrt.py MODEL_DIR WORKLOAD_JSON [--dtype float32|bfloat16] [--quantization int8|int4] [--skip-w1]
       [--out FILE]
"""
import argparse
import json
import os
import time
from statistics import median

import torch

from llmrt import LLM, SamplingParams

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("workload")
ap.add_argument("--dtype", default="bfloat16")
ap.add_argument("--w2-reps", type=int, default=3)
ap.add_argument("--skip-w1", action="store_true")
ap.add_argument("--attention-backend", default="auto")
ap.add_argument("--quantization", default=None, help="int8 | int4 (weight-only, at load; default: none)")
ap.add_argument("--out", help="also write the result JSON here")
args = ap.parse_args()


def main() -> None:
    """Run W1 then W2 and print (and write) the JSON the peers' scripts write."""
    import llmrt

    wl = json.load(open(args.workload))
    t = time.perf_counter()
    # KV for 64 sequences of up to 512 + 128 tokens (fp32: ~1 GiB); no prefix-cache hits, as for the peers.
    llm = LLM(args.model, dtype=args.dtype, max_model_len=1024, max_num_seqs=64, kv_cache_memory=2 << 30,
              enable_prefix_caching=False, attention_backend=args.attention_backend, quantization=args.quantization)
    res = {"peer": "llmrt", "version": llmrt.__version__, "torch": torch.__version__, "dtype": args.dtype,
           "quantization": args.quantization,
           "threads": torch.get_num_threads(), "attention_backend": type(llm.engine.executor.worker.model_runner
                                                                          .attn_backend).name,
           "startup_s": time.perf_counter() - t,
           "env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "LLMRT_", "KMP_"))}}
    greedy = dict(temperature=0.0, ignore_eos=True)
    llm.generate([wl["W2"]["prompt"][:32]], SamplingParams(max_tokens=8, **greedy))  # warm-up

    if not args.skip_w1:
        prompts, new = wl["W1"]["prompts"], wl["W1"]["max_new_tokens"]
        n_prompt = sum(len(p) for p in prompts)
        n_out = len(prompts) * new
        t0 = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=new, **greedy))
        wall = time.perf_counter() - t0
        assert all(len(o.outputs[0].token_ids) == new for o in outs)
        res["W1"] = {"wall_s": wall, "output_tok_s": n_out / wall, "total_tok_s": (n_prompt + n_out) / wall}
        print(res["W1"], flush=True)

    p, new = wl["W2"]["prompt"], wl["W2"]["max_new_tokens"]
    runs = []
    toks: list[int] = []
    for _ in range(args.w2_reps):
        out = llm.generate([p], SamplingParams(max_tokens=new, **greedy))[0]
        m = out.metrics
        toks = list(out.outputs[0].token_ids)
        assert len(toks) == new, len(toks)
        runs.append({"ttft_ms": (m.first_token_time - m.arrival_time) * 1e3,
                     "tpot_ms": (m.last_token_time - m.first_token_time) / (new - 1) * 1e3,
                     "e2e_s": m.last_token_time - m.arrival_time})
    res["W2"] = {"runs": runs, "ttft_ms": median(r["ttft_ms"] for r in runs),
                 "tpot_ms": median(r["tpot_ms"] for r in runs), "first16": toks[:16]}
    print(json.dumps(res, indent=1))
    if args.out:
        json.dump(res, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
