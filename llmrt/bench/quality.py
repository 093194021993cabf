"""`llmrt bench quality`: perplexity and teacher-forced top-1 agreement of a quantized model vs the unquantized one.

Logits come from the engine's own model classes through the paged KV cache (prefill in chunks, so later chunks
read earlier KV back from the cache: a quantized KV cache is exercised too).
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from llmrt.config import ModelConfig
from llmrt.engine.memory_plan import parameter_bytes
from llmrt.engine_args import default_of
from llmrt.hardware import check_formats
from llmrt.model.loader import load_model
from llmrt.model.standalone import bind_fresh_kv, chunk_inputs

DEFAULT_TEXT = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park with "
                "her friends. One day, she saw a big red ball under a tree. She wanted to play with it, so she ran "
                "to get it. But the ball was stuck. Lily tried to pull it, but it would not move. Her mom came and "
                "helped her. Together they pulled and pulled, and the ball came out. Lily was very happy and said "
                "thank you to her mom. They played with the ball all day long.")


@torch.inference_mode()
def teacher_forced_logits(model_cfg: ModelConfig, tokens: list[int], kv_cache_dtype: str = "auto",
                          block_size: int = 4, chunk: int = 16,
                          device: torch.device | str = "cpu") -> tuple[torch.Tensor, int]:
    """(float32 logits on the CPU at every position of `tokens`, weight bytes) for `model_cfg` on `device`,
    prefilled in chunks. The configuration's formats are checked for the device first, as the engine does."""
    device = torch.device(device)
    check_formats(device, model_cfg.torch_dtype, model_cfg.quantization, kv_cache_dtype)
    model = load_model(model_cfg, device)
    hidden = prefill(model, model_cfg.torch_dtype, tokens, kv_cache_dtype, block_size, chunk)
    return torch.cat([model.compute_logits(h) for h in hidden]).float().cpu(), parameter_bytes(model)


@torch.inference_mode()
def prefill(model: torch.nn.Module, dtype: torch.dtype, tokens: list[int], kv_cache_dtype: str = "auto",
            block_size: int = 4, chunk: int = 16) -> list[torch.Tensor]:
    """The final hidden states of one sequence, prefilled in chunks through a fresh paged KV cache (so later
    chunks read earlier KV back from the cache), on the model's device."""
    device = next(model.parameters()).device
    blocks = -(-len(tokens) // block_size)
    backend = bind_fresh_kv(model, blocks, block_size, dtype, kv_cache_dtype)
    table = list(range(blocks))
    return [model(*chunk_inputs(tokens[start:start + chunk], start, table, block_size, backend, device))
            for start in range(0, len(tokens), chunk)]


@dataclass
class QualityReport:
    """How far a configuration's logits are from the reference's on the same tokens."""

    label: str
    perplexity: float
    top1_agreement: float  # fraction of positions whose argmax equals the reference's
    max_abs_logit_error: float
    rel_logit_error: float  # max |error| over the reference's max |logit|
    mean_kl: float  # mean KL(reference || this) of the next-token distributions: steadier than perplexity
    weights_bytes: int
    seconds: float
    # the 95% interval of the perplexity change against the reference, as fractions (ppl_change_interval)
    ppl_change_ci: tuple[float, float] = (0.0, 0.0)


def token_nll(logits: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """The negative log-likelihood of each next token (len(tokens) - 1 values)."""
    return torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(tokens[1:]), reduction="none")


def perplexity(logits: torch.Tensor, tokens: list[int]) -> float:
    """exp(mean NLL of each next token)."""
    return float(torch.exp(token_nll(logits, tokens).mean()))


# A 95% interval for the perplexity change, by a moving-block bootstrap over token positions: neighbouring tokens'
# losses are correlated, so positions are resampled in runs of BOOTSTRAP_BLOCK (wrapping around) rather than one
# by one. The change is paired (the same positions for both models), which removes the text's own difficulty.
BOOTSTRAP_BLOCK = 16
BOOTSTRAP_SAMPLES = 2000


def ppl_change_interval(nll: torch.Tensor, ref_nll: torch.Tensor, samples: int = BOOTSTRAP_SAMPLES,
                        block: int = BOOTSTRAP_BLOCK, seed: int = 0) -> tuple[float, float]:
    """(low, high) of the 95% bootstrap interval of perplexity / reference perplexity - 1, as fractions."""
    d = (nll - ref_nll).double()
    n = d.numel()
    if n == 0:
        return 0.0, 0.0
    block = max(1, min(block, n))
    starts = torch.randint(0, n, (samples, -(-n // block)), generator=torch.Generator().manual_seed(seed))
    idx = ((starts[..., None] + torch.arange(block)) % n).view(samples, -1)[:, :n]
    changes = torch.expm1(d[idx].mean(-1))
    lo, hi = torch.quantile(changes, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return lo, hi


def compare(label: str, logits: torch.Tensor, ref: torch.Tensor, tokens: list[int], weights: int,
            seconds: float) -> QualityReport:
    """The report of `logits` against `ref`."""
    err = (logits - ref).abs().max().item()
    kl = torch.nn.functional.kl_div(logits.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                    reduction="batchmean").item()
    nll = token_nll(logits, tokens)  # once: the perplexity and its change's interval
    agree = float((logits.argmax(-1) == ref.argmax(-1)).float().mean())
    return QualityReport(label, float(torch.exp(nll.mean())), agree, err, err / max(ref.abs().max().item(), 1e-12),
                         kl, weights, seconds, ppl_change_interval(nll, token_nll(ref, tokens)))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `llmrt bench quality`."""
    p.add_argument("model", nargs="?", default="", help="model directory (default: the embedded stories260K)")
    p.add_argument("--reference", default=None,
                   help="the unquantized model to compare against: MODEL is then scored as it is (e.g. a GPTQ "
                        "checkpoint from `llmrt quantize`), and --quantization applies to the reference")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--quantization", action="append", choices=["int8", "int4", "fp8"], default=None,
                   help="a configuration to measure (repeatable; default: int8 and int4, none with --reference)")
    p.add_argument("--quant-group-size", type=int, default=32, choices=[32, 64, 128])
    p.add_argument("--quant-calibration", default="none", metavar="{none,builtin,PATH}",
                   help="int4 configurations calibrated by GPTQ at load, as `serve --quant-calibration` (the "
                        "checkpoint cached; int8 is unaffected) (default: %(default)s)")
    p.add_argument("--quant-calibration-samples", type=int,
                   default=default_of(ModelConfig, "quant_calibration_samples"),
                   help="--quant-calibration: calibration sequences (default: %(default)s)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8"], help="also for the quantized runs")
    p.add_argument("--device", default="cpu", help="where the models run: cpu (default), cuda or cuda:N")
    p.add_argument("--text", default=None, help="a text file to score (default: a built-in short story)")
    p.add_argument("--max-tokens", type=int, default=512, help="score at most this many tokens")
    p.add_argument("--chunk", type=int, default=16,
                   help="tokens per forward step (default: %(default)s); 1 scores every position in a one-token "
                        "step, as decode runs, so the decode-sized kernels (which may round activations "
                        "differently from the batched ones) are the ones measured")
    p.add_argument("--output", default=None, help="write the reports as JSON here")


def run(args: argparse.Namespace) -> int:
    """Score the unquantized model and each quantized configuration on the same tokens."""
    from llmrt.tokenizer import load_tokenizer

    if args.chunk < 1:
        raise SystemExit(f"--chunk must be at least 1, got {args.chunk}")

    source = args.reference if args.reference is not None else args.model
    # A GGUF dequantized, not its default.
    base = ModelConfig(source, dtype=args.dtype, quantization="none")
    text = Path(args.text).read_text() if args.text else DEFAULT_TEXT
    tokens = load_tokenizer(base.model).encode(text)[: min(args.max_tokens, int(base.max_model_len))]
    t = time.perf_counter()
    ref, ref_bytes = teacher_forced_logits(base, tokens, chunk=args.chunk, device=args.device)
    reports = [compare("unquantized", ref, ref, tokens, ref_bytes, time.perf_counter() - t)]
    if args.reference is not None:
        cfg = ModelConfig(args.model, dtype=args.dtype)
        t = time.perf_counter()
        logits, nbytes = teacher_forced_logits(cfg, tokens, args.kv_cache_dtype, chunk=args.chunk, device=args.device)
        reports.append(compare(checkpoint_label(cfg), logits, ref, tokens, nbytes, time.perf_counter() - t))
    default = [] if args.reference is not None else ["int8", "int4"]
    for q in args.quantization or default:
        calibration = args.quant_calibration if q == "int4" else "none"
        cfg = ModelConfig(source, dtype=args.dtype, quantization=q, quant_group_size=args.quant_group_size,
                          quant_calibration=calibration, quant_calibration_samples=args.quant_calibration_samples)
        t = time.perf_counter()  # with --quant-calibration: includes calibrating on a first load
        logits, nbytes = teacher_forced_logits(cfg, tokens, args.kv_cache_dtype, chunk=args.chunk, device=args.device)
        label = cfg.quantization_label + (f" kv {args.kv_cache_dtype}" if args.kv_cache_dtype != "auto" else "")
        reports.append(compare(label, logits, ref, tokens, nbytes, time.perf_counter() - t))
    base_ppl = reports[0].perplexity
    print(f"{base.model}: {len(tokens)} tokens, {args.chunk} a step")
    width = max(22, *(len(r.label) for r in reports))
    print(f"{'config':<{width}} {'perplexity':>10} {'ppl +%':>7} {'95% interval':>16} {'top-1 agree':>11} "
          f"{'mean KL':>8} {'max |dlogit|':>12} {'weights MiB':>11}")
    for r in reports:
        ci = f"[{100 * r.ppl_change_ci[0]:+.2f}, {100 * r.ppl_change_ci[1]:+.2f}]"
        print(f"{r.label:<{width}} {r.perplexity:>10.4f} {100 * (r.perplexity / base_ppl - 1):>7.2f} {ci:>16} "
              f"{r.top1_agreement:>11.4f} {r.mean_kl:>8.4f} {r.max_abs_logit_error:>12.4f} "
              f"{r.weights_bytes / (1 << 20):>11.2f}")
    print(f"95% interval: of the perplexity change, paired, by a bootstrap over runs of {BOOTSTRAP_BLOCK} token "
          f"positions ({BOOTSTRAP_SAMPLES} samples)")
    if args.output:
        Path(args.output).write_text(json.dumps({"model": base.model, "tokens": len(tokens),
                                                 "reports": [asdict(r) for r in reports]}, indent=2))
    return 0


def checkpoint_label(cfg: ModelConfig) -> str:
    """'MODEL (gptq g32 asym)': a checkpoint scored as it is, named by its quantization_config."""
    qc = cfg.hf_config.get("quantization_config") or {}
    name = Path(cfg.model).name
    if not qc:
        return f"{name} ({cfg.quantization or 'unquantized'})"
    sym = "sym" if qc.get("sym", True) else "asym"
    return f"{name} ({qc.get('quant_method')} g{qc.get('group_size', qc.get('q_group_size'))} {sym})"


def quality_of(model_dir: str, tokens: list[int], quantization: Optional[str], kv_cache_dtype: str = "auto",
               group_size: int = 32, ref: Optional[torch.Tensor] = None, as_stored: bool = False,
               device: torch.device | str = "cpu", dtype: str = "float32", chunk: int = 16,
               **model_options: Any) -> QualityReport:
    """One configuration against the unquantized float32 model (or `ref`), for tests and scripts; `as_stored`:
    the checkpoint in its own format (a GPTQ checkpoint as int4), `ref` then required; `chunk`: tokens a step (1:
    decode-sized steps); `model_options`: more ModelConfig fields (quant_calibration=...)."""
    if ref is None:
        ref, _ = teacher_forced_logits(ModelConfig(model_dir, dtype="float32", quantization="none"), tokens,
                                       device=device)
    cfg = ModelConfig(model_dir, dtype=dtype, quantization=None if as_stored else quantization or "none",
                      quant_group_size=group_size, **model_options)
    t = time.perf_counter()
    logits, nbytes = teacher_forced_logits(cfg, tokens, kv_cache_dtype, chunk=chunk, device=device)
    return compare(checkpoint_label(cfg) if as_stored else str(quantization), logits, ref, tokens, nbytes,
                   time.perf_counter() - t)
