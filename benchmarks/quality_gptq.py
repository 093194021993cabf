"""RTN vs GPTQ checkpoints written by `llmrt quantize`, against llmrt's load-time int4, on stories260K.

Every checkpoint is written by `quantize_checkpoint` (what `llmrt quantize` runs) from the same builtin calibration
sequences (sampled from the float model: not the evaluation texts) and scored by the quality bench's own functions
(`llmrt bench quality MODEL --reference ...`) on the built-in story and benchmarks/quality-stories.txt.

    OMP_NUM_THREADS=1 python benchmarks/quality_gptq.py --samples 128 --out benchmarks/quality-stories260K-gptq.json
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from llmrt.bench.quality import DEFAULT_TEXT, compare, teacher_forced_logits
from llmrt.config import ModelConfig
from llmrt.model.quantization.gptq_calibrate import CalibrationOptions, calibration_samples, quantize_checkpoint
from llmrt.model.quantization.gptq_solver import QuantSpec
from llmrt.tokenizer import load_tokenizer

MODEL = str(Path(__file__).resolve().parents[1] / "llmrt" / "data" / "stories260K")


def main() -> None:
    """Quantize each (method, group, sym) and print/write perplexity change, KL and top-1 for both texts."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--groups", default="32,64,128")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    tok = load_tokenizer(MODEL)
    stories = Path(__file__).resolve().parent / "quality-stories.txt"
    texts = {"builtin": tok.encode(DEFAULT_TEXT), "stories": tok.encode(stories.read_text())[:512]}
    refs = {k: teacher_forced_logits(ModelConfig(MODEL, dtype="float32", quantization="none"), t)[0]
            for k, t in texts.items()}
    base = {k: compare("", refs[k], refs[k], t, 0, 0).perplexity for k, t in texts.items()}
    samples = calibration_samples(MODEL, CalibrationOptions(samples=args.samples, seq_len=args.seq_len,
                                                            seed=args.seed))
    rows: list[dict] = []

    def score(label: str, cfg: ModelConfig, extra: dict) -> None:
        for k, t in texts.items():
            r = compare(label, teacher_forced_logits(cfg, t)[0], refs[k], t, 0, 0)
            rows.append(dict(config=label, text=k, perplexity=r.perplexity, change_pct=100 * (r.perplexity / base[k] - 1),
                             top1=r.top1_agreement, mean_kl=r.mean_kl, max_abs_logit_error=r.max_abs_logit_error, **extra))
            print(f"{label:24s} {k:8s} ppl {r.perplexity:.4f} {rows[-1]['change_pct']:+6.2f}% KL {r.mean_kl:.4f} "
                  f"top1 {r.top1_agreement:.3f}", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        for gs in map(int, args.groups.split(",")):
            score(f"llmrt int4 g{gs} (load)", ModelConfig(MODEL, dtype="float32", quantization="int4",
                                                           quant_group_size=gs), {})
            for sym in (False, True):
                for method in ("rtn", "gptq"):
                    out = f"{tmp}/{method}-g{gs}-{sym}"
                    t = time.perf_counter()
                    rep = quantize_checkpoint(MODEL, out, CalibrationOptions(method=method, spec=QuantSpec(gs, sym)),
                                              samples=samples)
                    ratio = sum(r.error for r in rep.layers) / sum(r.rtn_error for r in rep.layers)
                    score(f"{method} g{gs} {'sym' if sym else 'asym'}", ModelConfig(out, dtype="float32"),
                          {"calibration_output_error_vs_rtn": ratio, "quantize_seconds": time.perf_counter() - t})
    if args.out:
        Path(args.out).write_text(json.dumps({
            "model": "stories260K", "calibration": {"source": "builtin", "samples": len(samples),
                                                    "tokens": sum(map(len, samples)), "seed": args.seed},
            "base_perplexity": base, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
