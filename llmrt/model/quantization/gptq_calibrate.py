"""`llmrt quantize`: calibrate a float checkpoint on activations (GPTQ) and write a GPTQ-format checkpoint.

The inputs of every decoder linear layer are collected with llmrt's own model forward (paged KV cache, one prefill
per calibration sequence) as the Hessian H = sum x x^T; layers are quantized one at a time in execution order
(true-sequential: each layer's inputs come from the layers before it already quantized; `gptq_inputs.py` replays
the finished decoder layers' outputs instead of recomputing them). The result is AutoGPTQ's
format (`quant_method: gptq`, `checkpoint_format: gptq`, no act-order), which `gptq_awq.py` serves as int4.
`--method rtn` writes the same format by round-to-nearest of the same group ranges, for comparison.
"""
from __future__ import annotations

import json
import logging
import random
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from llmrt.config import ModelConfig
from llmrt.errors import InvalidRequestError, UnsupportedError
from llmrt.model.layers.linear import Linear
from llmrt.model.loader import build_model, checkpoint_target, checkpoint_tensors, load_weights
from llmrt.model.quantization.gptq_inputs import SequentialInputs, call_order, decoder_layers
from llmrt.model.quantization.gptq_solver import (QuantSpec, dequantize, gptq_quantize, output_error, pack_gptq,
                                                  rtn_quantize)

logger = logging.getLogger(__name__)
# Weight files a checkpoint directory may hold besides its safetensors, none of them copied into the GPTQ one.
_WEIGHT_SUFFIXES = frozenset({".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx",
                              ".npz"})


@dataclass
class CalibrationOptions:
    """What `llmrt quantize` does: the method, the format, and the calibration data."""

    method: str = "gptq"  # or "rtn"
    spec: QuantSpec = field(default_factory=QuantSpec)
    calibration: str = "builtin"  # "builtin": text sampled from the float model itself; else a text file
    samples: int = 64
    seq_len: int = 256
    damp: float = 0.01
    seed: int = 0
    device: str = "cpu"  # where the model runs and GPTQ solves (e.g. "cuda")


@dataclass
class LayerResult:
    """One quantized layer: its output error on the calibration inputs, GPTQ's (or RTN's) and RTN's."""

    name: str
    error: float
    rtn_error: float


@dataclass
class QuantizeReport:
    """What `quantize_checkpoint` did."""

    out_dir: str
    calibration_tokens: int
    layers: list[LayerResult]
    seconds: float


def calibration_samples(model_dir: str, opts: CalibrationOptions) -> list[list[int]]:
    """Token sequences to calibrate on: windows of the user's text, or sequences the float model samples itself
    (temperature 1 from BOS: data-free, and never the quality bench's evaluation text)."""
    from llmrt.tokenizer import load_tokenizer

    if opts.calibration != "builtin":
        path = Path(opts.calibration)
        if not path.is_file():
            raise InvalidRequestError(f"calibration file {path} does not exist", param="calibration")
        ids = load_tokenizer(model_dir).encode(path.read_text())
        if len(ids) < 16:
            raise InvalidRequestError(f"calibration file {path} holds only {len(ids)} tokens", param="calibration")
        windows = [ids[i:i + opts.seq_len] for i in range(0, len(ids), opts.seq_len)]
        windows = [w for w in windows if len(w) >= 16]
        random.Random(opts.seed).shuffle(windows)
        return windows[:opts.samples]
    from llmrt.engine.llm import LLM
    from llmrt.sampling_params import SamplingParams

    llm = LLM(model_dir, dtype="float32", device=opts.device)
    bos = llm.get_tokenizer().bos_token_id
    start = [bos] if bos is not None else [0]
    params = [SamplingParams(max_tokens=opts.seq_len - 1, temperature=1.0, seed=opts.seed + i)
              for i in range(opts.samples)]
    try:
        outs = llm.generate([start] * opts.samples, params)
    finally:
        llm.shutdown()
    return [start + list(o.outputs[0].token_ids) for o in outs]


def _float_config(model_dir: str) -> ModelConfig:
    """The checkpoint's configuration in float32, refused if it is not a float safetensors checkpoint."""
    if not Path(model_dir).is_dir():
        raise UnsupportedError("llmrt quantize reads a safetensors checkpoint directory (not a GGUF file)",
                               param="model")
    cfg = ModelConfig(model_dir, dtype="float32")
    if cfg.quantization:
        raise UnsupportedError(f"{model_dir} is already quantized ({cfg.quantization}); quantize a float checkpoint",
                               param="model")
    return cfg


def _float_model(cfg: ModelConfig, device: str) -> nn.Module:
    """The checkpoint in float32 with plain `weight` tensors (not repacked for the kernels: they are rewritten)."""
    model = build_model(cfg.hf_config, cfg.architecture, torch.float32, torch.float32, device)
    load_weights(model, Path(cfg.model))
    return model.eval()


def _quantize_one(name: str, layer: Linear, h: torch.Tensor, opts: CalibrationOptions
                  ) -> tuple[tuple[torch.Tensor, ...], LayerResult]:
    """GPTQ (or RTN) of one layer given its input Hessian; its weights become the dequantized ones."""
    w = layer.weight.data
    k = w.shape[1]
    pad = -k % opts.spec.group_size  # zero inputs up to whole groups, as the int4 storage pads them
    wp, hp = torch.nn.functional.pad(w, (0, pad)), torch.nn.functional.pad(h, (0, pad, 0, pad))
    rtn = rtn_quantize(wp, opts.spec)
    qzs = gptq_quantize(wp, hp, opts.spec, opts.damp) if opts.method == "gptq" else rtn
    wq = dequantize(*qzs, opts.spec.group_size)[:, :k]
    rtn_error = output_error(w, dequantize(*rtn, opts.spec.group_size)[:, :k], h)
    result = LayerResult(name, output_error(w, wq, h), rtn_error)
    logger.info("%s: output error %.4g (round-to-nearest %.4g)", name, result.error, result.rtn_error)
    layer.weight.data = wq.to(w.dtype)
    return tuple(t.cpu() for t in qzs), result


def quantize_layers(model: nn.Module, samples: list[list[int]], opts: CalibrationOptions
                    ) -> tuple[dict[str, tuple[torch.Tensor, ...]], list[LayerResult]]:
    """Quantize every decoder linear in order, each on inputs from the already-quantized ones before it
    (its weights replaced by their dequantized values). Returns ({name: (q, z, s)}, results)."""
    order = call_order(model, samples[0])
    linears = [n for n, m in order if isinstance(m, Linear)]
    prefix, layers = decoder_layers(model, linears[0])
    outside = [n for n in linears if not n.startswith(f"{prefix}.") or not n[len(prefix) + 1:].split(".")[0].isdigit()]
    if outside:  # refused before any layer is calibrated
        raise UnsupportedError(f"decoder linear(s) {', '.join(outside)} outside {prefix}: cannot calibrate them "
                               "layer by layer")
    inputs = SequentialInputs(model, samples)
    quantized, results = {}, []
    try:
        for i, decoder_layer in enumerate(layers):
            modules = [(n, m) for n, m in order if n.startswith(f"{prefix}.{i}.")]
            attention: Optional[nn.Module] = None  # one whose inputs are final: replayed once recorded
            replayed: list[nn.Module] = []
            for name, module in modules:
                if not isinstance(module, Linear):
                    attention = module
                    continue
                h, recorded = inputs.hessian(module, record=attention)
                if attention is not None:
                    inputs.replay(attention, recorded)
                    replayed.append(attention)
                    attention = None
                quantized[name], result = _quantize_one(name, module, h, opts)
                results.append(result)
            if i + 1 < len(layers):
                outputs = inputs.outputs(decoder_layer)
                for module in replayed:  # the whole layer replays from now on: its attention's outputs are dropped
                    inputs.restore(module)
                # Every finished layer returns the latest layer's outputs (the earlier ones' are not read); only
                # the last one's are handed to a layer that computes, which may update them in place.
                for done in layers[:i + 1]:
                    inputs.replay(done, outputs, copy=done is decoder_layer)
    finally:
        inputs.close()
    return quantized, results


def write_checkpoint(model: nn.Module, src: Path, out: Path, quantized: dict[str, tuple[torch.Tensor, ...]],
                     quant_config: dict) -> None:
    """`src`'s tensors with each quantized projection's weight replaced by its packed GPTQ tensors, plus its
    config (with `quant_config`) and tokenizer files."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for hf_name, tensor in checkpoint_tensors(src, model.hf_config):
        name, shard = checkpoint_target(model, hf_name)
        module = name.rsplit(".", 1)[0]
        if not hf_name.endswith(".weight") or module not in quantized:
            tensors[hf_name] = tensor.load().contiguous()
            continue
        q, z, s = quantized[module]
        layer = model.get_submodule(module)
        rows = layer.shard_slice(shard) if shard is not None else slice(None)
        base = hf_name.removesuffix(".weight")
        tensors.update({f"{base}.{k}": v for k, v in pack_gptq(q[rows], z[rows], s[rows], quant_config["group_size"],
                                                                     layer.in_features).items()})
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in src.iterdir():  # config, tokenizer, license...: not other copies of the weights
        if f.is_file() and f.suffix not in _WEIGHT_SUFFIXES and not f.name.endswith(".index.json"):
            shutil.copy(f, out / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = quant_config
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


def quantize_checkpoint(model_dir: str, out_dir: str, opts: CalibrationOptions,
                        samples: Optional[list[list[int]]] = None) -> QuantizeReport:
    """Calibrate `model_dir` (a float safetensors checkpoint) and write the GPTQ checkpoint to `out_dir`."""
    t0 = time.perf_counter()
    if opts.method not in ("gptq", "rtn"):
        raise InvalidRequestError(f"method {opts.method!r}: expected gptq or rtn", param="method")
    if Path(out_dir).resolve() == Path(model_dir).resolve():
        raise InvalidRequestError("--out must differ from the source checkpoint", param="out")
    cfg = _float_config(model_dir)
    # Sampled before the float model is built: the sampling engine's own copy of the weights is gone by then.
    samples = samples if samples is not None else calibration_samples(model_dir, opts)
    model = _float_model(cfg, opts.device)
    limit = int(cfg.max_model_len)
    samples = [s[:limit] for s in samples if s]
    if not samples:
        raise InvalidRequestError("no calibration samples", param="samples")
    with torch.inference_mode():
        quantized, results = quantize_layers(model, samples, opts)
    qc = {"quant_method": "gptq", "bits": 4, "group_size": opts.spec.group_size, "sym": opts.spec.sym,
          "desc_act": False, "static_groups": False, "true_sequential": True, "damp_percent": opts.damp,
          "checkpoint_format": "gptq",
          "quantizer": [f"llmrt quantize --method {opts.method}"],
          "llmrt_calibration": {"source": opts.calibration, "samples": len(samples), "seq_len": opts.seq_len,
                                "seed": opts.seed, "tokens": sum(map(len, samples)),
                                "clip_search": opts.spec.clip_search}}
    write_checkpoint(model, Path(model_dir), Path(out_dir), quantized, qc)
    return QuantizeReport(out_dir, sum(map(len, samples)), results, time.perf_counter() - t0)


def report_dict(report: QuantizeReport) -> dict:
    """The report as JSON-ready data."""
    return asdict(report)
