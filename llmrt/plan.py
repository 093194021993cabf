"""`llmrt plan`: the memory breakdown and capacity of a model on a device, from its config.json alone."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from llmrt.config import QUANT_GROUP_SIZES, CacheConfig, ModelConfig, SchedulerConfig, context_limit, parse_dtype
from llmrt.engine_args import default_of, parse_bytes
from llmrt.engine.memory_plan import MemoryPlan, plan_memory
from llmrt.errors import InvalidRequestError, ModelLoadError
from llmrt.table import format_table

_GiB = 1 << 30


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The plan command's flags."""
    p.add_argument("model", help="an HF model directory or its config.json (no weights needed)")
    p.add_argument("--memory", type=parse_bytes, required=True, help="memory of one device, e.g. 80GiB or 24GB")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weight and compute dtype; auto takes the config's (default: auto)")
    p.add_argument("--kv-dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="KV-cache dtype (default: the weight dtype)")
    p.add_argument("--quantization", default=None, choices=["int8", "int4", "fp8"],
                   help="weight-only quantization of the decoder layers, as `serve` (default: none)")
    p.add_argument("--quant-group-size", type=int, default=default_of(ModelConfig, "quant_group_size"),
                   choices=list(QUANT_GROUP_SIZES), help="int4 group size (default: %(default)s)")
    p.add_argument("--quant-calibration", default="none", metavar="{none,builtin,PATH}",
                   help="as `serve`: int4 calibrated by GPTQ at load (the same bytes as plain int4) "
                        "(default: %(default)s)")
    p.add_argument("--lm-head-quantization", default="auto", choices=["auto", "int8", "none"],
                   help="the LM head's format, as `serve`: auto is int8 with --quantization int8/int4 "
                        "(default: %(default)s)")
    p.add_argument("--dense-weight-copy", default=default_of(ModelConfig, "dense_weight_copy"),
                   choices=["auto", "on", "off"],
                   help="CPU, as `serve`: packed fp32/bf16 layers also keep dense weights (counted in weights); "
                        "auto: when they take at most 1/8 of --memory (default: %(default)s)")
    p.add_argument("--kv-cache-dtype", default=default_of(CacheConfig, "kv_cache_dtype"), choices=["auto", "int8", "fp8"],
                   help="KV-cache storage, as `serve`: auto (--kv-dtype), int8 or fp8 with per-token scales "
                        "(default: %(default)s)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks the model is split over (default: 1)")
    p.add_argument("--pp", type=int, default=1,
                   help="pipeline stages (contiguous layers); memory per rank counts the heaviest stage's real "
                        "weights (embedding on the first, norm + LM head on the last) and one stage's KV layers, "
                        "and the communication estimate adds the stage-to-stage sends and the bubble (default: 1)")
    p.add_argument("--interconnect", type=parse_rate, default=None,
                   help="link bandwidth between ranks, e.g. 50GB/s (NVLink ~450GB/s, PCIe 4 x16 ~25GB/s, "
                        "100 Gb Ethernet ~12GB/s); prints the communication estimate (default: 50GB/s when "
                        "--tp or --pp > 1)")
    p.add_argument("--interconnect-latency", type=float, default=10e-6,
                   help="seconds of fixed cost per message on that link (default: %(default)s)")
    p.add_argument("--device-bandwidth", type=parse_rate, default=3.35e12,
                   help="one rank's memory bandwidth, bounding decode compute (default: 3.35TB/s, H100-class)")
    p.add_argument("--device-flops", type=float, default=989e12,
                   help="one rank's dense FLOP/s, bounding prefill compute (default: 989e12, H100-class bf16)")
    p.add_argument("--micro-batches", type=int, default=4,
                   help="micro-batches per step for the pipeline estimate (default: %(default)s)")
    p.add_argument("--context", default="1024,4096,32768",
                   help="comma-separated context lengths to report capacity at (default: 1024,4096,32768)")
    p.add_argument("--gpu-memory-utilization", type=float, default=default_of(CacheConfig, "gpu_memory_utilization"),
                   help="fraction of the memory the engine may use, as `serve` (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=default_of(CacheConfig, "block_size"),
                   help="tokens per KV block (default: %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=default_of(SchedulerConfig, "max_num_batched_tokens"),
                   help="the step token budget that sets the activation peak (default: %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=default_of(SchedulerConfig, "max_num_seqs"),
                   help="most sequences in one batch (default: %(default)s)")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's context length")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")


def parse_rate(text: str) -> float:
    """'50GB/s', '2TB/s', '25e9' -> bytes per second."""
    t = text.strip().lower().removesuffix("/s").removesuffix("ps")
    if t.endswith("tb"):
        return float(t[:-2]) * 1e12
    return float(parse_bytes(t))


def load_hf_config(path: str) -> dict[str, Any]:
    """config.json from a model directory or the file itself."""
    p = Path(path)
    cfg = p / "config.json" if p.is_dir() else p
    if not cfg.is_file():
        raise ModelLoadError(f"{path!r}: no config.json there")
    return json.loads(cfg.read_text())


def build_plan(args: argparse.Namespace) -> tuple[MemoryPlan, dict[str, Any]]:
    """The plan for the parsed arguments, and the settings it assumed."""
    hf = load_hf_config(args.model)
    if args.tp < 1:
        raise InvalidRequestError("--tp must be >= 1", param="tp")
    if args.pp < 1:
        raise InvalidRequestError("--pp must be >= 1", param="pp")
    from llmrt.distributed.sizes import check_pipeline_parallel, check_tensor_parallel

    check_tensor_parallel(hf, (hf.get("architectures") or [""])[0], args.tp)
    check_pipeline_parallel(hf, (hf.get("architectures") or [""])[0], args.pp)
    try:
        contexts = tuple(int(c) for c in str(args.context).split(",") if c.strip())
    except ValueError:
        raise InvalidRequestError(f"--context takes comma-separated integers, got {args.context!r}", param="context")
    if not contexts or min(contexts) < 1:
        raise InvalidRequestError("--context needs at least one positive length", param="context")
    dtype = parse_dtype(args.dtype, hf)
    kv_dtype = parse_dtype(args.kv_dtype, hf) if args.kv_dtype else dtype
    limit = args.max_model_len or context_limit(hf)
    from llmrt.model.quantization import resolve_lm_head

    from llmrt.model.quantization.gptq_at_load import calibration_source, check_calibration
    from llmrt.model.quantization.gptq_awq import checkpoint_quantization

    # The refusals `serve` makes at configuration time, with the same errors.
    calibration = calibration_source(check_calibration(args.quant_calibration, args.quantization, args.model, hf,
                                                       default_of(ModelConfig, "quant_calibration_samples")))
    lm_head = resolve_lm_head(args.lm_head_quantization, args.quantization or checkpoint_quantization(hf))
    plan = plan_memory(hf, memory_bytes=args.memory, dtype=dtype, kv_dtype=kv_dtype, tp=args.tp,
                       block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
                       max_num_seqs=args.max_num_seqs, max_model_len=limit,
                       utilization=args.gpu_memory_utilization, contexts=contexts,
                       quantization=args.quantization, quant_group_size=args.quant_group_size,
                       kv_cache_dtype=args.kv_cache_dtype, pp=args.pp, lm_head_quantization=lm_head,
                       dense_weight_copy=args.dense_weight_copy)
    settings = dict(model=args.model, architecture=(hf.get("architectures") or [""])[0], memory_bytes=args.memory,
                    utilization=args.gpu_memory_utilization, dtype=str(dtype).replace("torch.", ""),
                    kv_dtype=str(kv_dtype).replace("torch.", ""), tp=args.tp, pp=args.pp, max_model_len=limit,
                    quantization=args.quantization, quant_calibration=calibration, lm_head_quantization=lm_head,
                    kv_cache_dtype=args.kv_cache_dtype,
                    dense_weight_copy=args.dense_weight_copy,
                    formats_here=[f.as_dict() for f in formats_on_this_machine(dtype, args.quantization,
                                                                               args.kv_cache_dtype)])
    return plan, settings


def communication(args: argparse.Namespace, hf: dict[str, Any], dtype: Any) -> list[dict[str, Any]]:
    """The communication estimate for a decode step of one and of max-num-seqs sequences and a full prefill
    step (empty without a split or --interconnect)."""
    import torch

    from llmrt.distributed.comm_model import Device, Link, estimate_step
    from llmrt.model.loader import build_model

    if args.tp == 1 and args.pp == 1 and args.interconnect is None:
        return []
    arch = (hf.get("architectures") or [""])[0]
    params = sum(p.numel() for p in build_model(hf, arch, dtype, dtype, "meta").parameters())
    link = Link(args.interconnect or 50e9, args.interconnect_latency)
    device = Device(args.device_bandwidth, args.device_flops)
    elem = torch.empty((), dtype=dtype).element_size()
    steps = [("decode, 1 sequence", 1, 1), (f"decode, {args.max_num_seqs} sequences", args.max_num_seqs,
                                              args.max_num_seqs),
             (f"prefill, {args.max_num_batched_tokens} tokens", args.max_num_batched_tokens, 1)]
    out = []
    for name, tokens, rows in steps:
        e = estimate_step(hf, tp=args.tp, pp=args.pp, link=link, device=device, elem_bytes=elem, params=params,
                          tokens=tokens, sampled_rows=rows, micro_batches=min(args.micro_batches, rows))
        out.append({"step": name, **e.as_dict()})
    return out


def formats_on_this_machine(dtype: Any, quantization: Any, kv_cache_dtype: str) -> list[Any]:
    """How this machine's device would compute the planned formats (reported, never refused: a plan may be for
    another machine)."""
    import torch

    from llmrt.hardware import format_support

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    fmts = [str(dtype).replace("torch.", "")] if dtype != torch.float32 else []
    fmts += [quantization] if quantization else []
    fmts += [f"kv:{kv_cache_dtype}"] if kv_cache_dtype != "auto" else []
    return [format_support(device, f) for f in fmts]


def verdict(plan: MemoryPlan, max_model_len: int) -> list[str]:
    """What fits, in words."""
    if plan.num_blocks == 0:
        return ["does not fit: weights and the activation peak leave no room for a single KV block"]
    lines = []
    for c, n in plan.concurrency().items():
        if c > max_model_len:
            lines.append(f"{c} tokens: beyond the model's context of {max_model_len}")
        elif n == 0:
            lines.append(f"{c} tokens: does not fit (one sequence needs {c * plan.kv_bytes_per_token / _GiB:.2f} GiB "
                         f"of KV, {plan.kv_cache_bytes / _GiB:.2f} GiB is left)")
        else:
            lines.append(f"{c} tokens: fits, up to {n} concurrent sequences")
    return lines


def run(args: argparse.Namespace) -> int:
    """Print the plan."""
    plan, settings = build_plan(args)
    comm = communication(args, load_hf_config(args.model), parse_dtype(args.dtype, load_hf_config(args.model)))
    if args.json:
        print(json.dumps({**settings, **plan.as_dict(), "verdict": verdict(plan, settings["max_model_len"]),
                          "communication": comm}, indent=2))
        return 0
    gib = lambda b: f"{b / _GiB:.3f}"  # noqa: E731
    usable = int(args.memory * args.gpu_memory_utilization)
    rows = [
        {"item": "device memory x utilization", "GiB": gib(usable), "detail": f"{args.memory} B x {args.gpu_memory_utilization}"},
        {"item": "weights", "GiB": gib(plan.weights_bytes),
         "detail": f"per rank, tp={args.tp}" + (f", heaviest of pp={args.pp} stages" if args.pp > 1 else "")
                   + f", {settings['dtype']}"
                   + (f", decoder layers {args.quantization}" if args.quantization else "")
                   + (f" (GPTQ, {settings['quant_calibration']} calibration)"
                      if settings["quant_calibration"] != "none" else "")
                   + (f", LM head {settings['lm_head_quantization']}" if args.quantization else "")
                   + (f", incl. {gib(plan.dense_copy_bytes)} GiB dense copies of packed layers (--dense-weight-copy)"
                      if plan.dense_copy_bytes else "")},
        {"item": "activation peak", "GiB": gib(plan.activation_peak_bytes),
         "detail": f"a step of {min(args.max_num_batched_tokens, settings['max_model_len'])} tokens (estimate)"},
        {"item": "KV cache", "GiB": gib(plan.kv_cache_bytes),
         "detail": f"{plan.num_blocks} blocks x {plan.block_size} tokens x {plan.kv_bytes_per_token} B/token "
                   f"({plan.kv_format}) = {plan.max_tokens} tokens"},
    ]
    print(f"{settings['architecture']} ({settings['model']})")
    print(format_table(rows, ["item", "GiB", "detail"]))
    print()
    cap = [{"context": c, "max concurrent sequences": n} for c, n in plan.concurrency().items()]
    print(format_table(cap, ["context", "max concurrent sequences"]))
    print()
    print("\n".join(verdict(plan, settings["max_model_len"])))
    for f in settings["formats_here"]:
        print(f"on this machine's {f['device']}: {f['format']} is {f['status']}: {f['detail']}")
    if comm:
        ms = lambda s: f"{s * 1e3:.3f}"  # noqa: E731
        print(f"\ncommunication estimate: tp={args.tp} pp={args.pp}, link {(args.interconnect or 50e9) / 1e9:g} GB/s "
              f"+ {args.interconnect_latency * 1e6:g} us per message (docs/parallel.md)")
        rows = [{"step": c["step"], "compute ms": ms(c["compute_seconds"]), "TP comm ms": ms(c["tp_seconds"]),
                 "PP comm ms": ms(c["pp_seconds"]), "comm share": f"{c['comm_share']:.0%}",
                 "PP bubble": f"{c['bubble_share']:.0%}", "bytes/token": f"{c['comm_bytes_per_token']:.0f}"}
                for c in comm]
        print(format_table(rows, ["step", "compute ms", "TP comm ms", "PP comm ms", "comm share", "PP bubble",
                                  "bytes/token"]))
    return 0
