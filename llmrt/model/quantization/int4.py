"""Weight-only int4: asymmetric group-wise (a scale and a zero per group of input weights), packed two per byte.

On CPU with llmrt's kernels (llmrt/kernels), weights are packed in their layout (llmrt/kernels/packed.py: blocks of
4 rows, `pack_int4_chunks` byte order) with bf16 scales and zeros: small steps run the kernel, larger ones
dequantize into one reused buffer and run the compute dtype's GEMM. Without them, layers whose output size is a
multiple of 16 use torch's packed int4 kernel (bf16 activations). Elsewhere (CUDA, or neither) the nibbles are
packed plainly and dequantized to the compute dtype per matmul.
Values follow tinygemm's convention: w = (q - 8) * scale + zero, q in [0, 15].
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrt.model.layers.linear import UnquantizedLinearMethod, register_packed_bias, unpacked, use_kernel
from llmrt.model.quantization.base import QuantizationConfig

if TYPE_CHECKING:
    from llmrt.model.layers.linear import Linear


CLIP_SEARCH = (1.0, 0.97, 0.94, 0.91, 0.88, 0.85, 0.82, 0.79, 0.76)


REFIT_ROUNDS = 3


def _round_to_grid(g: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15)


def _refit(g: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The least-squares (lo, scale) of w ~= q * scale + lo per group, for fixed integers q."""
    n = g.shape[-1]
    sq, sw, sqq, sqw = q.sum(-1), g.sum(-1), (q * q).sum(-1), (q * g).sum(-1)
    det = n * sqq - sq * sq
    flat = det <= 1e-12  # every q equal: the scale is free, the mean is the best constant
    scale = torch.where(flat, torch.ones_like(sq), (n * sqw - sq * sw) / det.clamp(min=1e-12)).clamp(min=1e-12)
    lo = torch.where(flat, sw / n, (sw - scale * sq) / n)
    return lo, scale


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q int32 [N, K] in [0, 15], scales [N, K/g], zeros [N, K/g]) with w ~= (q - 8) * scale + zero."""
    n, k = w.shape
    g = w.float().view(n, k // group_size, group_size)
    lo0, hi0 = g.amin(-1), g.amax(-1)
    best_err = torch.full_like(lo0, float("inf"))
    lo, scale = lo0.clone(), torch.ones_like(lo0)

    def keep_if_better(c_lo: torch.Tensor, c_scale: torch.Tensor) -> None:
        nonlocal best_err, lo, scale
        err = ((_round_to_grid(g, c_lo, c_scale) * c_scale[..., None] + c_lo[..., None] - g) ** 2).sum(-1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        lo, scale = torch.where(better, c_lo, lo), torch.where(better, c_scale, scale)

    # Shrinking the range clips a few outliers but rounds the rest finer: keep, per group, the range with the
    # least squared error (on the embedded model, min-max alone has a 5% higher mean KL to the float model; its
    # 169-token perplexity is too noisy to rank the two).
    for shrink in CLIP_SEARCH:
        keep_if_better(lo0 * shrink, ((hi0 - lo0) * shrink / 15.0).clamp(min=1e-12))
    # Then alternate (HQQ-style): for the chosen integers, the least-squares scale and offset, then re-round.
    # This lowers the weight error by ~4% more (random and trained weights) for REFIT_ROUNDS extra passes.
    for _ in range(REFIT_ROUNDS):
        keep_if_better(*_refit(g, _round_to_grid(g, lo, scale)))
    q = _round_to_grid(g, lo, scale).to(torch.int32).view(n, k)
    zero = lo + 8.0 * scale
    return q, scale, zero


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """int [N, K] in [0, 15] -> uint8 [N, K/2], even columns in the low nibble."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_nibbles(p: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> uint8 [N, K]."""
    return torch.stack([p & 0xF, p >> 4], dim=-1).view(p.shape[0], -1)


def pack_int4_chunks(q: torch.Tensor) -> torch.Tensor:
    """int [N, K] in [0, 15], K a multiple of 32 -> uint8 [N, K/2], the layout of llmrt's int4 kernel: per chunk
    of 32 inputs, byte c holds q[c] in its low nibble and q[c + 16] in its high one (one 16-byte load unpacks to
    two runs of 16 consecutive inputs)."""
    n, k = q.shape
    c = q.to(torch.uint8).view(n, k // 32, 2, 16)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_int4_chunks(p: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_int4_chunks: uint8 [N, K/2] -> uint8 [N, K]."""
    n = p.shape[0]
    c = p.view(n, -1, 16)
    return torch.stack([c & 0xF, c >> 4], dim=2).view(n, -1)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """The [N, K] weights in `dtype` from the plain nibble layout."""
    q = unpack_nibbles(packed).to(dtype)
    n, k = q.shape
    g = q.view(n, k // group_size, group_size)
    return ((g - 8) * scale.to(dtype)[..., None] + zero.to(dtype)[..., None]).view(n, k)


class Int4LinearMethod(UnquantizedLinearMethod):
    """Loads `weight` in the model dtype, then keeps packed 4-bit weights and per-group scales and zeros."""

    def __init__(self, group_size: int):
        self.group_size = group_size

    def process_weights_after_loading(self, layer: "Linear") -> None:
        w = layer.weight.data
        # Inputs not a multiple of the group size are padded with zero weights (and zero activations in apply).
        q, scale, zero = quantize_int4(F.pad(w, (0, -w.shape[1] % self.group_size)), self.group_size)
        del layer.weight
        self.store_quantized(layer, q, scale, zero)

    def store_quantized(self, layer: "Linear", q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> None:
        """Keep quantize_int4's (q, scale, zero), inputs padded to the group with zero weights, in this method's
        layout; also the entry for checkpoints that arrive quantized (GPTQ, AWQ, GGUF 4-bit)."""
        from llmrt.kernels import for_layer
        from llmrt.kernels.packed import PackedLinear

        layer.int4_in_pad = q.shape[1] - layer.in_features
        n = q.shape[0]
        use_ours = q.device.type == "cpu" and self.group_size % 32 == 0
        layer.kernels, layer.kernel_max_rows = for_layer("int4", q) if use_ours else (None, 0)
        # torch's packed int4 kernel where ours is missing (CPU, N % 16 == 0); ours is faster where it is built
        # (benchmarks/gemv-bandwidth.md, docs/quantization.md).
        layer.int4_torch_packed = layer.kernels is None and q.device.type == "cpu" and n % 16 == 0
        if layer.kernels is not None:
            layer.packed = PackedLinear.int4(layer.kernels, q, scale, zero, self.group_size, layer.in_features,
                                             layer.bias)
            layer.qweight = nn.Parameter(layer.packed.data, requires_grad=False)
            layer.scales_zeros = nn.Parameter(layer.packed.sz, requires_grad=False)
            register_packed_bias(layer)
        elif layer.int4_torch_packed:
            layer.qweight = nn.Parameter(torch._convert_weight_to_int4pack_for_cpu(q, 1), requires_grad=False)
            sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [K/g, N, 2]
            layer.scales_zeros = nn.Parameter(sz.bfloat16(), requires_grad=False)
        else:
            layer.qweight = nn.Parameter(pack_nibbles(q), requires_grad=False)
            layer.weight_scale = nn.Parameter(scale, requires_grad=False)
            layer.weight_zero = nn.Parameter(zero, requires_grad=False)

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        out_dtype, b = x.dtype, layer.bias
        if layer.packed is not None:
            if use_kernel(layer, x):  # pads x itself
                return layer.packed(x)
            w = unpacked(layer, x)
            x = F.pad(x, (0, layer.int4_in_pad)) if layer.int4_in_pad else x
            return F.linear(x.to(w.dtype), w, b.to(w.dtype) if b is not None else None).to(out_dtype)
        if layer.int4_in_pad:
            x = F.pad(x, (0, layer.int4_in_pad))
        if layer.int4_torch_packed:
            y = torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), layer.qweight, self.group_size,
                                                  layer.scales_zeros).to(out_dtype)
            return y + b.to(out_dtype) if b is not None else y
        w = dequantize_int4(layer.qweight, layer.weight_scale, layer.weight_zero, self.group_size, out_dtype)
        return F.linear(x, w, b.to(out_dtype) if b is not None else None)


class Int4Config(QuantizationConfig):
    """--quantization int4 [--quant-group-size 32|64|128]."""

    name = "int4"

    def __init__(self, group_size: int = 32, lm_head: str = "int8"):
        self.group_size = group_size
        # The LM head in int8, as llama.cpp keeps output.weight above 4 bits in its Q4 files (Q6_K): its logits
        # decide every token, and int4 there costs more quality than its bytes save (docs/quantization.md).
        self.lm_head = lm_head

    def linear_method(self, layer: "Linear") -> Int4LinearMethod:
        return Int4LinearMethod(self.group_size)

    def lm_head_config(self) -> "QuantizationConfig | None":
        from llmrt.model.quantization.int8 import Int8Config

        return Int8Config(lm_head="none") if self.lm_head == "int8" else None

    def weight_bytes(self, out_features: int, in_features: int) -> int:
        from llmrt.kernels import kernels
        from llmrt.kernels.packed import packed_bytes

        if kernels() is not None and self.group_size % 32 == 0:  # llmrt's layout: rows padded to 4s
            return packed_bytes("int4", out_features, in_features, self.group_size)
        groups = -(-in_features // self.group_size)
        return out_features * groups * (self.group_size // 2 + 2 * 2)  # nibbles, a bf16 scale and zero per group

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> "Int4Config":
        return cls(int(options.get("group_size", 32)), options.get("lm_head", "int8"))
