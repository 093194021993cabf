"""Linear layers: plain and fused (several HF projections stored as one matmul), computed by a LinearMethod."""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import nn

from llmrt.distributed.parallel_state import communicator, tp_shard
from llmrt.model.layers.weights import (CheckpointTensor, as_checkpoint_tensor, copy_checked, reads_slices,
                                        set_weight_loader)

if TYPE_CHECKING:
    from llmrt.model.quantization.base import QuantizationConfig

logger = logging.getLogger(__name__)


class _UpcastWorkspace:
    """One reusable buffer for weights whose storage dtype is narrower than the compute dtype.

    Layers run one after another, so one buffer serves them all; reusing it avoids page-faulting a fresh
    allocation of every weight on every step.
    """

    def __init__(self) -> None:
        self._bufs: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def buffer(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised tensor of `shape` in the shared buffer (valid until the next call)."""
        numel = math.prod(shape)
        key = (device, dtype)
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._bufs[key] = buf
        return buf[:numel].view(shape)

    def cast(self, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`w` converted to `dtype`, in the shared buffer (valid until the next call)."""
        out = self.buffer(tuple(w.shape), dtype, w.device)
        out.copy_(w)
        return out


UPCAST = _UpcastWorkspace()
KERNEL_X_DTYPES = (torch.float32, torch.bfloat16)  # activations llmrt's kernels take


def use_kernel(layer: "Linear", x: torch.Tensor) -> bool:
    """Whether this step of `layer` runs llmrt's own kernels (chosen at load, by rows, for 2-D fp32/bf16 x): up to
    its vector kernels' rows, or a step the packed layer runs on a batched int8/int4 kernel (AMX tiles or vdpbf16ps
    panels: `PackedLinear.on_batch_kernel`)."""
    if x.dim() != 2 or x.dtype not in KERNEL_X_DTYPES:
        return False
    return x.shape[0] <= layer.kernel_max_rows or (layer.packed is not None and layer.packed.on_batch_kernel(x))


def pack_for_kernels(layer: "Linear", w: torch.Tensor, scale: Optional[torch.Tensor] = None) -> None:
    """Keep fp32/bf16 (or int8 with row `scale`) weights in the kernels' packed layout (`layer.packed`, its
    tensors registered as parameters so memory plans count them), and only there unless `layer.keep_dense` (then
    `layer.weight` stays for torch's GEMM on larger steps). A tied LM head's packed copy is extra memory: the
    embedding keeps its rows for lookups."""
    from llmrt.kernels.packed import PackedLinear

    layer.packed = PackedLinear.dense(layer.kernels, w, layer.bias, scale)
    if hasattr(layer, "weight") and not layer.keep_dense:
        del layer.weight
    elif layer.keep_dense and layer.prepack_dense and scale is None and onednn_prepack(w.dtype) \
            and layer.compute_dtype in (None, w.dtype):
        prepack_dense_copy(layer)
    layer.weight_packed = nn.Parameter(layer.packed.data, requires_grad=False)
    if layer.packed.scale is not None:
        layer.weight_scale = nn.Parameter(layer.packed.scale, requires_grad=False)
    register_packed_bias(layer)


# Rows oneDNN's weight reorder is tuned for: a batched decode step. Prefill-sized steps measured no slower with it
# than with torch's GEMM on the plain copy (2048 rows: 0.96x).
ONEDNN_BATCH_HINT = 64
# Rows up to which our kernels still beat oneDNN on its prepacked weights (whole 124.7M model's linears, 2 threads,
# AVX512-BF16, weights streamed from memory; ours / oneDNN ms): bf16 2 rows 5.0 / 8.8, 3 rows 6.2 / 7.4, 4 rows
# 7.9 / 6.9, 8 rows 19.2 / 9.3, 64 rows 77.5 / 32.3; fp32 3 rows 11.6 / 11.9, 4 rows 14.4 / 11.2, 64 rows 80.5 /
# 62.2. Our kernels' own limits (kernels.max_rows) were measured against torch's GEMM on plain weights.
ONEDNN_KERNEL_MAX_ROWS = 3
_PREPACK_REFUSED: set[torch.dtype] = set()  # dtypes whose refusal was logged (once per process)


def onednn_prepack(dtype: torch.dtype) -> bool:
    """Whether kept dense copies of `dtype` weights are held in oneDNN's blocked layout for torch's mkldnn linear
    (LLMRT_ONEDNN_PREPACK=1, the default, where torch has mkldnn and, for bf16, oneDNN computes it natively)."""
    choice = os.environ.get("LLMRT_ONEDNN_PREPACK", "1").lower()
    if choice not in ("0", "1", "off", "on"):
        raise ValueError(f"LLMRT_ONEDNN_PREPACK={choice!r}: expected 1 or 0")
    if choice in ("0", "off") or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def prepack_dense_copy(layer: "Linear") -> None:
    """Replace `layer.weight`, the dense copy kept for steps larger than the kernels take, by the same weights in
    oneDNN's blocked layout (what vLLM's CPU build runs): torch's GEMM reorders a plain weight on every call.
    Measured on the 124.7M Llama, 2 threads, AVX512-BF16: one layer's GEMMs at 64 rows 0.89x, the LM head 0.81x,
    W1 throughput +12% (bf16) and +9% (fp32). It also beats our kernels above 3 rows (also with oneDNN capped
    to AVX2: fp32 3 rows 18.5 vs 19.3 ms, 6 rows 24.0 vs 21.9), so the layer's kernel rows drop to
    ONEDNN_KERNEL_MAX_ROWS. The copy is an nn.Parameter (memory plans count it); a recorded step reads
    it as any other weight."""
    w = layer.weight
    try:
        prepacked = torch.ops.mkldnn._reorder_linear_weight(w.data, ONEDNN_BATCH_HINT)
    except RuntimeError as e:  # a oneDNN capped below the CPU's ISA (ONEDNN_MAX_CPU_ISA) refuses bf16 here
        if w.dtype not in _PREPACK_REFUSED:
            _PREPACK_REFUSED.add(w.dtype)
            logger.warning("oneDNN cannot prepack %s weights (%s); their plain dense copies are kept", w.dtype,
                           str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
        return
    layer.weight_onednn = nn.Parameter(prepacked, requires_grad=False)
    del layer.weight
    layer.kernel_max_rows = min(layer.kernel_max_rows, ONEDNN_KERNEL_MAX_ROWS)


def register_packed_bias(layer: "Linear") -> None:
    """Register the packed layout's float32 bias copy as a buffer: it is the layer's memory, and a recorded step
    (llmrt/worker/step_graph.py) may only read the model's own tensors."""
    if layer.packed.bias is not None:
        layer.register_buffer("bias_packed", layer.packed.bias, persistent=False)


def dense_copy_layers(model: nn.Module) -> tuple[list["Linear"], int]:
    """`model`'s unquantized fp32/bf16 Linears (the ones packed for the kernels on CPU) and the bytes their dense
    weights take beside the packed layout (a weight shared with another module, a tied LM head's, adds none)."""
    uses = parameter_uses(model)
    layers = [m for m in model.modules() if isinstance(m, Linear) and type(m.method) is UnquantizedLinearMethod
              and _dense_copy(m).dtype in (torch.float32, torch.bfloat16)]
    copies = [_dense_copy(m) for m in layers]
    return layers, sum(w.numel() * w.element_size() for w in copies if uses[id(w)] == 1)


def parameter_uses(model: nn.Module) -> dict[int, int]:
    """id(parameter) -> how many module attributes hold it (2 for a weight tied between two modules)."""
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    return uses


def _dense_copy(layer: "Linear") -> torch.Tensor:
    """The layer's dense weight: `weight`, or its oneDNN-layout replacement (prepack_dense_copy)."""
    return layer.weight_onednn if layer.weight_onednn is not None else layer.weight


def unpacked(layer: "Linear", x: torch.Tensor) -> torch.Tensor:
    """`layer.packed`'s weights as a dense [out, in] matrix in x's dtype (float32 for other dtypes), in the
    shared upcast buffer: for steps larger than the kernels take (torch's GEMM runs them)."""
    p = layer.packed
    dtype = x.dtype if x.dtype in KERNEL_X_DTYPES else torch.float32
    return p.unpack_into(UPCAST.buffer((p.n, p.padded_in if p.fmt == "int4" else p.k), dtype, x.device))


class LinearMethod:
    """How a Linear stores its weights and multiplies by them (unquantized, int8, int4, fp8, ...)."""

    def create_weights(self, layer: "Linear", in_features: int, out_features: int, bias: bool) -> None:
        """Register the layer's parameters, each with its weight_loader."""
        raise NotImplementedError

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        """y = x W^T + b with the layer's parameters."""
        raise NotImplementedError

    @staticmethod
    def create_bias(layer: "Linear", out_features: int, bias: bool) -> None:
        """The layer's bias (model dtype, the layer's own loader) or None: the same for every weight format."""
        layer.bias = None
        if bias:
            layer.bias = set_weight_loader(nn.Parameter(torch.empty(out_features), requires_grad=False),
                                           layer.weight_loader)

    def process_weights_after_loading(self, layer: "Linear") -> None:
        """Repack or quantize once every tensor is loaded (nothing for unquantized weights)."""


class UnquantizedLinearMethod(LinearMethod):
    """Weights in the model dtype. fp32 and bf16 weights on CPU: steps of up to `kernel_max_rows` rows run llmrt's
    own kernel (llmrt/kernels: streams the weights once, fp32 accumulation); larger steps torch's GEMM over the
    dense copy when the layer keeps one (`keep_dense`), else over the weights unpacked. On CPUs that emulate
    bf16/fp16 matmuls, computes in the compute dtype through one reused upcast buffer, except for steps of at most
    `native_max_rows` rows (memory-bound)."""

    def create_weights(self, layer: "Linear", in_features: int, out_features: int, bias: bool) -> None:
        layer.weight = set_weight_loader(nn.Parameter(torch.empty(out_features, in_features), requires_grad=False),
                                         layer.weight_loader)
        self.create_bias(layer, out_features, bias)

    def process_weights_after_loading(self, layer: "Linear") -> None:
        w = layer.weight
        if w.dtype in (torch.bfloat16, torch.float32):
            from llmrt.kernels import for_layer

            upcast = w.dtype == torch.bfloat16 and layer.compute_dtype not in (None, torch.bfloat16)
            fmt = "fp32" if w.dtype == torch.float32 else "bf16 upcast" if upcast else "bf16"
            layer.kernels, layer.kernel_max_rows = for_layer(fmt, w)
            if layer.kernels is not None:
                pack_for_kernels(layer, w.data)

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        b = layer.bias
        if use_kernel(layer, x):
            return layer.packed(x)
        wp = layer.weight_onednn
        if wp is not None and x.dim() == 2 and x.dtype == wp.dtype:
            return torch.ops.mkldnn._linear_pointwise(x, wp, b, "none", [], "")
        w = layer.weight if layer.packed is None or (layer.keep_dense and wp is None) else unpacked(layer, x)
        if layer.compute_dtype is not None and w.dtype != layer.compute_dtype:
            if x.shape[0] <= layer.native_max_rows:
                return F.linear(x.to(w.dtype), w, b).to(layer.compute_dtype)
            w = UPCAST.cast(w, layer.compute_dtype)
            b = b.to(layer.compute_dtype) if b is not None else None
        return F.linear(x, w, b)


@dataclass(frozen=True)
class OutputShard:
    """Where one projection's rows on this rank come from: checkpoint rows [start, start + length), stored in
    `size` rows (size > length only for a vocabulary padded to a multiple of the ranks; the rest stay zero)."""

    start: int
    length: int
    size: int


def split_evenly(full: int, what: str) -> OutputShard:
    """This rank's equal share of `full` rows (refused, naming the numbers, when they do not divide)."""
    shard = tp_shard()
    if full % shard.size:
        raise ValueError(f"{what} of {full} does not divide into {shard.size} tensor-parallel ranks")
    per = full // shard.size
    return OutputShard(shard.rank * per, per, per)


class Linear(nn.Module):
    """y = x W^T + b, where W may be several HF projections stacked along the output dim.

    `parallel` says how the layer is split over tensor-parallel ranks: "replicated" (whole on every rank),
    "column" (each rank holds `shards`, a slice of every projection's rows; default an equal share) or "row"
    (each rank holds an equal slice of the input columns; the partial outputs are summed by one all-reduce,
    and only rank 0 adds the bias).
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 compute_dtype: Optional[torch.dtype] = None, quant_config: Optional["QuantizationConfig"] = None,
                 parallel: str = "replicated", shards: Optional[list[OutputShard]] = None):
        super().__init__()
        tp = tp_shard()
        self.tp_size = tp.size
        self.parallel = parallel if tp.size > 1 else "replicated"
        self.full_output_sizes = list(output_sizes)
        if self.parallel == "column":
            shards = shards or [split_evenly(n, "an output dimension") for n in output_sizes]
        else:
            shards = [OutputShard(0, n, n) for n in output_sizes]
        self.shards = shards
        self.input_start = 0
        if self.parallel == "row":
            cols = split_evenly(in_features, "an input dimension")
            self.input_start, in_features = cols.start, cols.length
        self.bias_on_this_rank = self.parallel != "row" or tp.rank == 0
        self.comm = communicator() if self.parallel == "row" else None
        self.in_features = in_features
        self.output_sizes = [s.size for s in shards]
        self.out_features = sum(self.output_sizes)
        self.compute_dtype = compute_dtype
        self.native_max_rows = 0  # see hardware.native_half_max_rows; set by the loader for the device
        self.row_tile = 0  # > 0: --deterministic, matmuls on fixed-size row tiles (model/layers/batch_invariant.py)
        self.kernels = None  # llmrt.kernels.KernelLib when the method chose our kernels (process_weights_after_loading)
        self.kernel_max_rows = 0  # steps of up to this many rows run them
        self.packed = None  # llmrt.kernels.packed.PackedLinear: the weights in the kernels' layout
        # Packed fp32/bf16 weights also kept dense for torch's GEMM on larger steps (set by the loader from
        # --dense-weight-copy, kernels.packed.keep_dense_copy); otherwise such steps unpack into a shared buffer.
        self.keep_dense = False
        # ... and held in oneDNN's layout (prepack_dense_copy), unless the weight is shared (a tied LM head's)
        self.prepack_dense = False
        self.register_parameter("weight_onednn", None)
        self.quant_config = quant_config
        self.method: LinearMethod = quant_config.linear_method(self) if quant_config else UnquantizedLinearMethod()
        self.method.create_weights(self, in_features, self.out_features, bias)

    def dense_weight(self) -> torch.Tensor:
        """The [out, in] weight: `weight`, or a copy unpacked from the kernels' layout (bf16 stays bf16, fp32
        fp32; int8/int4 dequantized to float32, int4 inputs padded to its group)."""
        p = self.packed
        if p is None or (self.keep_dense and self.weight_onednn is None):
            return self.weight
        dtype = torch.bfloat16 if p.fmt == "bf16" else torch.float32
        return p.unpack_into(torch.empty(p.n, p.padded_in if p.fmt == "int4" else p.k, dtype=dtype))

    def shard_slice(self, shard: int) -> slice:
        """Rows of the fused weight that belong to HF projection number `shard`."""
        start = sum(self.output_sizes[:shard])
        return slice(start, start + self.output_sizes[shard])

    @reads_slices
    def weight_loader(self, param: nn.Parameter, loaded: "torch.Tensor | CheckpointTensor",
                      shard_id: Optional[int] = None) -> None:
        """Copy this rank's part of a checkpoint tensor into `param`: the whole fused tensor (shard_id None) or
        projection `shard_id`; a row-parallel layer reads only its input columns."""
        loaded = as_checkpoint_tensor(loaded)
        is_bias = param.dim() == 1
        projections = range(len(self.shards)) if shard_id is None else [shard_id]
        full_rows = sum(self.full_output_sizes[i] for i in projections)
        cols = self.in_features * (self.tp_size if self.parallel == "row" else 1)
        expected = (full_rows,) if is_bias else (full_rows, cols)
        if tuple(loaded.shape) != expected:
            raise ValueError(f"has shape {tuple(loaded.shape)} but the model expects {expected}")
        if self.parallel == "row":
            if is_bias:
                if self.bias_on_this_rank:
                    copy_checked(param.data, loaded)
                else:  # summed over ranks by the all-reduce: rank 0 alone adds it
                    param.data.zero_()
                return
            copy_checked(param.data[self.shard_slice(shard_id)] if shard_id is not None else param.data,
                         loaded.narrow(1, self.input_start, self.in_features))
            return
        offset = 0  # row of projection i within the loaded tensor
        for i in projections:
            s = self.shards[i]
            target = param.data[self.shard_slice(i)]
            copy_checked(target[:s.length], loaded.narrow(0, offset + s.start, s.length))
            if s.size > s.length:
                target[s.length:].zero_()
            offset += self.full_output_sizes[i]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_tile:
            from llmrt.model.layers.batch_invariant import tiled_apply

            y = tiled_apply(self, x, self.row_tile)
        else:
            y = self.method.apply(self, x)
        return self.comm.all_reduce(y) if self.comm is not None else y
