"""Loading HF safetensors checkpoints (single or sharded) into llmrt's model classes."""
from __future__ import annotations

import contextlib
import json
import logging
import threading
from pathlib import Path
from typing import Iterator, Optional

import torch
from safetensors import safe_open
from tqdm import tqdm

from llmrt.config import ModelConfig
from llmrt.errors import ModelLoadError
from llmrt.hardware import compute_dtype, device_memory_free_total, native_half_max_rows
from llmrt.model.gguf_file import gguf_tensors, is_gguf
from llmrt.model.layers.linear import Linear, dense_copy_layers, parameter_uses
from llmrt.model.layers.norms import LayerNorm, RMSNorm
from llmrt.model.models.base import CausalLM
from llmrt.model.layers.weights import CheckpointTensor, weight_loader_of
from llmrt.model.models.registry import resolve_architecture
from llmrt.model.quantization import QuantizationConfig, get_quantization_config
from llmrt.model.quantization.gguf_int4 import GgufInt4Config

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint, from its index when sharded."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / n for n in names]
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} names shards that are missing: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors files in {model_dir} (only safetensors checkpoints are supported)")
    return files


def checkpoint_tensors(path: Path, hf_config: dict, int4_rows: bool = False) -> Iterator[tuple[str, CheckpointTensor]]:
    """(HF tensor name, the tensor, read lazily) for a safetensors directory or a GGUF file (`int4_rows`: its
    4-bit decoder weights as Int4Rows instead of dequantized). A safetensors tensor is memory-mapped: a
    tensor-parallel rank that reads a slice of it reads only that slice."""
    if is_gguf(str(path)):
        for name, tensor in gguf_tensors(str(path), hf_config, int4_rows):
            if isinstance(tensor, torch.Tensor):
                yield name, CheckpointTensor.of(tensor)
            else:  # Int4Rows: read whole by GgufInt4Method's loader
                yield name, CheckpointTensor(tuple(tensor.q.shape), lambda index, t=tensor: t)
        return
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for hf_name in f.keys():
                part = f.get_slice(hf_name)
                yield hf_name, CheckpointTensor(tuple(part.get_shape()), lambda index, p=part: p[index])


def _norms_in_compute_dtype(model: CausalLM, compute: torch.dtype) -> None:
    """Norm weights in the compute dtype where it is wider than the parameters' (bf16 weights on a CPU without bf16
    arithmetic compute in float32): the fused norm then takes them as they are, instead of every call falling back
    to ~10 torch ops that upcast the weight anyway (25 norms a step, ~70 us each on an AVX2 CPU). The same values:
    the torch path multiplies by the weight in float32 too; the loader casts the checkpoint's into them."""
    for module in model.modules():
        if isinstance(module, (RMSNorm, LayerNorm)):
            for p in module.parameters(recurse=False):
                if p.is_floating_point() and p.dtype.itemsize < compute.itemsize:
                    p.data = p.data.to(compute)


def build_model(hf_config: dict, arch: str, dtype: torch.dtype, compute: torch.dtype,
                device: torch.device | str, quant_config: Optional[QuantizationConfig] = None) -> CausalLM:
    """Construct `arch`'s model with `dtype` parameters on `device`, unfilled ("meta" for sizes only); norm
    weights are in `compute` where it is wider (see _norms_in_compute_dtype)."""
    cls = resolve_architecture(arch)
    with torch.device(device), _default_dtype(dtype):
        model = cls(hf_config, compute, arch, quant_config=quant_config)
    _norms_in_compute_dtype(model, compute)
    return model


def load_model(model_cfg: ModelConfig, device: torch.device) -> CausalLM:
    """Build the model for `model_cfg` on `device` and fill it from the checkpoint (with --quant-calibration, from
    its cached GPTQ checkpoint, calibrated first if there is none)."""
    if model_cfg.quant_calibration != "none":
        from llmrt.model.quantization.gptq_at_load import calibrated_model_config

        model_cfg = calibrated_model_config(model_cfg, str(device))
    arch = model_cfg.architecture
    dtype = model_cfg.torch_dtype
    quant = get_quantization_config(model_cfg.quantization, model_cfg.quant_options())
    # A GGUF served as int4 with its own block size keeps its 4-bit tensors' integers (gguf_int4.py).
    int4_rows = is_gguf(model_cfg.model) and model_cfg.quantization == "int4" and model_cfg.quant_group_size == 32
    if int4_rows:
        quant = GgufInt4Config(model_cfg.quant_options()["lm_head"])
    try:
        model = build_model(model_cfg.hf_config, arch, dtype, compute_dtype(device, dtype), device, quant)
    except KeyError as e:
        raise ModelLoadError(f"config.json of {model_cfg.model} lacks the field {e.args[0]!r} that {arch} needs")
    native_rows = native_half_max_rows(device, dtype)
    for module in model.modules():
        if isinstance(module, Linear):
            module.native_max_rows = native_rows
    load_weights(model, Path(model_cfg.model), int4_rows)
    _choose_dense_copies(model, model_cfg.dense_weight_copy, device)
    for module in model.modules():
        if isinstance(module, Linear):
            module.method.process_weights_after_loading(module)
    if model_cfg.quantization:
        head = "int8, per output channel" if model_cfg.lm_head_quantization == "int8" else f"{dtype} (not quantized)"
        logger.info("weights %s; LM head %s (--lm-head-quantization)", model_cfg.quantization, head)
    return model.eval()


def _choose_dense_copies(model: CausalLM, setting: str, device: torch.device) -> None:
    """Mark the layers that keep dense weights beside the kernels' packed ones (--dense-weight-copy)."""
    from llmrt.kernels import kernels
    from llmrt.kernels.packed import keep_dense_copy

    layers, extra = dense_copy_layers(model)
    if device.type != "cpu" or not layers or kernels() is None:
        return  # nothing is packed: the layers keep their dense weights only
    _, total = device_memory_free_total(device)
    keep = keep_dense_copy(setting, extra, total)
    uses = parameter_uses(model)
    for m in layers:
        m.keep_dense = keep
        m.prepack_dense = keep and uses[id(m.weight)] == 1  # a shared (tied) weight stays plain for its other user
    logger.info("dense weight copy (--dense-weight-copy %s): %s, %.1f MiB beside the packed weights", setting,
                "kept for steps larger than the kernels take" if keep else "not kept (larger steps unpack)",
                extra / (1 << 20) if keep else 0.0)


def checkpoint_target(model: CausalLM, hf_name: str) -> tuple[str, int | None]:
    """(our parameter name, shard of a fused parameter or None) that checkpoint tensor `hf_name` fills."""
    name = model.hf_to_ours(hf_name) if hasattr(model, "hf_to_ours") else hf_name
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in model.packed_modules:
            fused, shard = model.packed_modules[part]
            parts[i] = fused
            return ".".join(parts), shard
    return name, None


def _weights_bar() -> tqdm:
    """A progress bar over the checkpoint's tensors (on a terminal only). tqdm's default lock adds a
    multiprocessing RLock, a named semaphore that a killed engine process leaves in /dev/shm: a thread lock does."""
    if not hasattr(tqdm, "_lock"):
        tqdm.set_lock(threading.RLock())
    return tqdm(desc="loading weights", unit="tensor", disable=None, leave=False)


def load_weights(model: CausalLM, model_dir: Path, int4_rows: bool = False) -> None:
    """Hand every checkpoint tensor to its parameter's weight_loader; name any tensor missing or misshapen."""
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = model.tied_parameters()
    expected: set[tuple[str, int | None]] = set()
    for name, p in params.items():
        if name in tied:
            continue
        module = model.get_submodule(name.rsplit(".", 1)[0])
        sizes = getattr(module, "output_sizes", [p.shape[0]])
        if getattr(p, "checkpoint_optional", False):
            continue
        if name.endswith("weight") or name.endswith("bias") or getattr(p, "loads_by_shard", False):
            shards = range(len(sizes)) if len(sizes) > 1 and _is_packed(model, name) else [None]
        else:
            shards = [None]
        expected.update((name, s) for s in shards)

    loaded: set[tuple[str, int | None]] = set()
    unexpected: list[str] = []
    with _weights_bar() as bar:
        for hf_name, tensor in checkpoint_tensors(model_dir, model.hf_config, int4_rows):
            bar.update(1)
            if hf_name.endswith(model.ignored_suffixes):
                continue
            name, shard = checkpoint_target(model, hf_name)
            name = model.checkpoint_alias.get(name, name)
            if name not in params and model.held_elsewhere(name):
                continue  # another pipeline stage's tensor: never read here
            if name in tied or name not in params:
                if name not in tied:
                    unexpected.append(hf_name)
                continue
            param = params[name]
            loader = weight_loader_of(param)
            tensor = model.transform_weight(hf_name, tensor)
            try:
                # A loader that reads slices gets the lazy tensor (a tensor-parallel rank reads only its part).
                loader(param, tensor if getattr(loader, "reads_slices", False) else tensor.load(), shard)
            except ValueError as e:
                raise ModelLoadError(f"tensor {hf_name!r} {e} (does config.json match the weights?)")
            loaded.add((name, shard))
    missing = sorted(expected - loaded, key=str)
    if missing:
        shown = ", ".join(f"{n}" + (f"[shard {s}]" if s is not None else "") for n, s in missing[:10])
        raise ModelLoadError(f"checkpoint {model_dir} is missing {len(missing)} tensor(s) the model needs: {shown}")
    if unexpected:
        logger.warning("ignored %d checkpoint tensor(s) the model does not use: %s", len(unexpected),
                       ", ".join(unexpected[:5]))


def _is_packed(model: CausalLM, name: str) -> bool:
    fused = {v[0] for v in model.packed_modules.values()}
    return any(part in fused for part in name.split("."))
