"""Ops and tensor allocations per W2 decode step (torch.profiler counts: independent of the machine's load), bf16 and fp32.

usage: PYTHONPATH=CHECKOUT python step_opcount.py   (reads /tmp/peers/models; prints one JSON line)
"""
import json
from torch.profiler import profile, ProfilerActivity
from llmrt import LLM, SamplingParams
M = "/tmp/peers/models/llama-syn-bf16"
wl = json.load(open("/tmp/peers/models/workload.json"))
out = {}
for dtype in ("bfloat16", "float32"):
    llm = LLM(M, dtype=dtype, max_model_len=1024, max_num_seqs=64, kv_cache_memory=1 << 30, enable_prefix_caching=False)
    llm._submit([wl["W2"]["prompt"]], [SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)])
    for _ in range(8): llm._step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(8): llm._step()
    ev = prof.key_averages()
    c = {e.key: e.count / 8 for e in ev}
    top = ("aten::mul", "aten::add", "aten::copy_", "aten::_to_copy", "aten::pow", "aten::mean", "aten::rsqrt",
           "aten::cat", "aten::index_copy_", "aten::index", "aten::contiguous", "aten::clone")
    out[dtype] = {"ops_per_step": sum(v for k, v in c.items() if "::" in k),
                  "allocations_per_step": sum(v for k, v in c.items() if k.startswith("aten::empty")),
                  **{k: c.get(k, 0) for k in top}}
    del llm
print(json.dumps(out))
