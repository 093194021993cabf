"""`llmrt bench peers` results: best of rounds, ratios to llmrt, fractions of the machine's floors, Markdown."""
from __future__ import annotations

from typing import Any, Optional

ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")


def isa_flags() -> list[str]:
    """The CPU flags that decide which kernels can run (from llmrt.hardware's /proc/cpuinfo read)."""
    from llmrt.hardware import cpu_flags

    return [f for f in ISA_FLAGS if f in cpu_flags()]


def _w1(run: dict[str, Any]) -> Optional[float]:
    w1 = run.get("W1")
    if not w1:
        return None
    if "output_tok_s" in w1:
        return w1["output_tok_s"]
    return max(v["output_tok_s"] for v in w1.values())  # HF: one entry per static batch size


def best_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Best W1 output tok/s and lowest W2 TTFT and TPOT over the rounds that finished."""
    ok = [r for r in runs if "W2" in r]
    if not ok:
        return {"runs_ok": 0, "errors": [r.get("error", "")[-300:] for r in runs]}
    w1 = [v for v in (_w1(r) for r in ok) if v is not None]
    return {"runs_ok": len(ok), "W1_output_tok_s": max(w1) if w1 else None,
            "W2_ttft_ms": min(r["W2"]["ttft_ms"] for r in ok), "W2_tpot_ms": min(r["W2"]["tpot_ms"] for r in ok),
            "first16": ok[-1]["W2"]["first16"], "load_before": [r["load_before"] for r in ok]}


def floors_for(floors: dict[str, Any], dtype: str) -> dict[str, float]:
    """W1 output tok/s at the best GEMM rate this machine showed, and W2's bandwidth floor per token (ms)."""
    peak = max(floors["floor_fp32_GFLOPs"], floors["floor_bf16_GFLOPs"]) * 1e9  # bf16 weights may compute in fp32
    out_tokens = floors["W1_tokens"]["output"]
    w1 = out_tokens / (floors["W1_flops_refined"] / peak)
    w2 = floors["W2_decode_floor_ms_bf16_streamed_params"] * (2 if dtype == "float32" else 1)
    return {"W1_output_tok_s": w1, "W2_tpot_ms": w2}


def ratios(best: dict[str, dict[str, Any]], floors: dict[str, Any]) -> dict[str, Any]:
    """Per dtype: llmrt over each peer (W1: >1 is llmrt ahead; TTFT/TPOT: <1 is llmrt ahead), and each system's
    fraction of the floors."""
    out: dict[str, Any] = {}
    for dtype, by in best.items():
        fl = floors_for(floors, dtype)
        me = by.get("llmrt", {})
        entry: dict[str, Any] = {"floors": fl, "fraction_of_floor": {}, "llmrt_over_peer": {}}
        for system, b in by.items():
            if not b.get("runs_ok"):
                continue
            entry["fraction_of_floor"][system] = {
                "W1": b["W1_output_tok_s"] / fl["W1_output_tok_s"] if b["W1_output_tok_s"] else None,
                "W2_tpot": fl["W2_tpot_ms"] / b["W2_tpot_ms"]}
            if system != "llmrt" and me.get("runs_ok"):
                entry["llmrt_over_peer"][system] = {
                    "W1_output_tok_s": (me["W1_output_tok_s"] / b["W1_output_tok_s"]
                                        if me["W1_output_tok_s"] and b["W1_output_tok_s"] else None),
                    "W2_ttft": me["W2_ttft_ms"] / b["W2_ttft_ms"], "W2_tpot": me["W2_tpot_ms"] / b["W2_tpot_ms"],
                    "same_first16": me["first16"] == b["first16"]}
        out[dtype] = entry
    return out


def _f(v: Optional[float], spec: str = ".1f") -> str:
    return "—" if v is None else format(v, spec)


def markdown(result: dict[str, Any]) -> str:
    """One page: machine and floors, the figures per dtype with ratios and floor fractions, then cold starts."""
    m, fl = result["machine"], result["floors"]
    lines = [f"# llmrt beside its peers ({result['date']})", "",
             f"Machine: {m['cpu']}, {m['cores']} cores, ISA {' '.join(m['isa'])}, torch {m['torch']} "
             f"({m['torch_threads']} threads). Load average at start {result['load_average_start'][0]:.1f}, at end "
             f"{result['load_average_end'][0]:.1f}. Best of {result['rounds']} alternating round(s).",
             f"Floors (floors.py): fp32 GEMM {fl['floor_fp32_GFLOPs']:.0f} GFLOP/s, bf16 GEMM "
             f"{fl['floor_bf16_GFLOPs']:.0f} GFLOP/s, copy bandwidth {fl['floor_bandwidth_GBps']:.1f} GB/s.", ""]
    for dtype, by in result["best"].items():
        if not any(runs for runs in result["runs"][dtype].values()):
            continue  # --rounds 0: cold starts only
        r = result["ratios"][dtype]
        lines += [f"## {dtype}", "",
                  f"Floors: W1 ≤ {r['floors']['W1_output_tok_s']:.0f} output tok/s (best GEMM rate), "
                  f"W2 TPOT ≥ {r['floors']['W2_tpot_ms']:.1f} ms (weights + KV read once per token).", "",
                  "| system | W1 out tok/s | W2 TTFT ms | W2 TPOT ms | W1 / floor | W2 floor / TPOT | llmrt ÷ peer: W1, "
                  "TTFT, TPOT | same first 16 tokens |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for system, b in by.items():
            if not b.get("runs_ok"):
                lines.append(f"| {system} | failed: {(b.get('errors') or ['not run'])[-1][-120:]!r} | | | | | | |")
                continue
            frac = r["fraction_of_floor"][system]
            rat = r["llmrt_over_peer"].get(system)
            rs = f"{_f(rat['W1_output_tok_s'], '.2f')}, {rat['W2_ttft']:.2f}, {rat['W2_tpot']:.2f}" if rat else "—"
            same = "—" if not rat else ("yes" if rat["same_first16"] else "no")
            lines.append(f"| {system} | {_f(b['W1_output_tok_s'])} | {b['W2_ttft_ms']:.0f} | {b['W2_tpot_ms']:.1f} | "
                         f"{_f(frac['W1'], '.0%')} | {frac['W2_tpot']:.0%} | {rs} | {same} |")
        lines.append("")
    cold = result.get("cold_start_s") or {}
    if cold:
        base = min(cold.get("python -c 'import torch'", [0.0]))
        lines += ["## Cold start (process spawn to exit after the first token; best of rounds)", "",
                  "| what | best s | over `import torch` s | all rounds s |", "| --- | --- | --- | --- |"]
        for name, ts in cold.items():
            lines.append(f"| {name} | {min(ts):.2f} | {min(ts) - base:+.2f} | {', '.join(f'{t:.2f}' for t in ts)} |")
        lines.append("")
    return "\n".join(lines)
