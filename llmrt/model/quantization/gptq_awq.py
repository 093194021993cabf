"""GPTQ and AWQ checkpoints (4-bit, group-wise, `quantization_config` in config.json) served by the int4 method.

Both store w = scale * (q - z) per group of input weights, packed eight 4-bit values to an int32:
- GPTQ: qweight int32 [K/8, N] packed along the input dim; qzeros int32 [G, N/8] along the output dim, holding
  z - 1 (AutoGPTQ's historical offset; `checkpoint_format: gptq_v2` holds z); scales [G, N]; g_idx [K].
- AWQ (`version: gemm`): qweight int32 [K, N/8] and qzeros [G, N/8], both packed along the output dim in the
  interleaved order 0, 2, 4, 6, 1, 3, 5, 7; scales [G, N].
The integers are kept as they are; only the zero point changes form: our int4 convention is
w = (q - 8) * scale + zero, so zero = scale * (8 - z), exact in float32. Act-order (a g_idx that is not
i // group_size), other bit widths and other AWQ packings are refused before any weight is read where the config
says so, else when the tensor arrives. A GPTQ layer whose input size is not a multiple of 8 cannot be packed
(qweight [K/8, N]) in AutoGPTQ's format; `llmrt quantize` writes such a layer (stories260K's 172-wide MLP) padded:
qweight [ceil(K/8), N], ceil(K/group) groups, and per projection of n rows ceil(n/8) qzeros words, the padding
nibbles ignored. Aligned layers (every real checkpoint's) are exactly AutoGPTQ's layout.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from llmrt.errors import UnsupportedError
from llmrt.model.layers.weights import copy_checked, set_weight_loader
from llmrt.model.quantization.int4 import Int4Config, Int4LinearMethod

if TYPE_CHECKING:
    from llmrt.model.layers.linear import Linear

_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
AWQ_UNPACK_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # nibble i of an AWQ int32 holds column AWQ_PACK_ORDER[i]
KERNEL_GROUP_SIZES = (128, 64, 32)


def unpack_int32(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> int32 [R, C, 8]: nibble i (bits 4i..4i+3) of each word."""
    return (packed.to(torch.int32)[..., None] >> _SHIFTS) & 0xF


def gptq_unpack(qweight: torch.Tensor, qzeros: torch.Tensor, zero_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ (qweight [K/8, N], qzeros [G, N/8]) -> (q [N, K], z [N, G])."""
    kp, n = qweight.shape
    q = unpack_int32(qweight).permute(0, 2, 1).reshape(kp * 8, n).t()
    z = unpack_int32(qzeros).reshape(qzeros.shape[0], -1).t() + zero_offset
    return q.contiguous(), z.contiguous()


def awq_unpack_cols(packed: torch.Tensor) -> torch.Tensor:
    """AWQ int32 [R, C/8] -> int32 [R, C] in column order."""
    return unpack_int32(packed)[..., list(AWQ_UNPACK_ORDER)].reshape(packed.shape[0], -1)


def checkpoint_group_size(qc: dict[str, Any]) -> int:
    """The group size a quantization_config states (-1: one group per row)."""
    return int(qc.get("group_size", qc.get("q_group_size", 128)))


class CheckpointInt4Config(Int4Config):
    """A 4-bit checkpoint (GPTQ or AWQ) computed by the int4 method, with the checkpoint's groups."""

    name = "int4-checkpoint"

    def __init__(self, checkpoint: dict[str, Any], lm_head: str = "none"):
        self.checkpoint = checkpoint
        self.ckpt_group_size = checkpoint_group_size(checkpoint)
        bits = int(checkpoint.get("bits", checkpoint.get("w_bit", 4)))
        if bits != 4:
            raise UnsupportedError(f"{self.name.upper()} checkpoints with {bits}-bit weights are not supported; "
                                   "only 4-bit (served by the int4 method)", param="quantization")
        # The checkpoint's LM head is unquantized; --lm-head-quantization int8 quantizes it at load.
        super().__init__(KERNEL_GROUP_SIZES[-1], lm_head=lm_head)

    def kernel_group_size(self, in_features: int) -> int:
        """The int4 group size for a layer: the checkpoint's, or a divisor of it that the kernels take."""
        ckpt = in_features if self.ckpt_group_size == -1 else self.ckpt_group_size
        for g in KERNEL_GROUP_SIZES:  # the last group may be padded (`llmrt quantize` of unaligned layers)
            if ckpt % g == 0 and (in_features % ckpt == 0 or self.ckpt_group_size != -1):
                return g
        raise UnsupportedError(f"{self.name.upper()} group size {self.ckpt_group_size} with {in_features} inputs "
                               f"cannot be served: groups must be a multiple of 32",
                               param="quantization")

    def linear_method(self, layer: "Linear") -> "CheckpointInt4Method":
        return CheckpointInt4Method(self, self.kernel_group_size(layer.in_features))

    def weight_bytes(self, out_features: int, in_features: int) -> int:
        from llmrt.kernels import kernels
        from llmrt.kernels.packed import packed_bytes

        g = self.kernel_group_size(in_features)
        if kernels() is not None:  # llmrt's layout: rows padded to 4s
            return packed_bytes("int4", out_features, in_features, g)
        return out_features * (in_features // 2 + in_features // g * 2 * 2)

    def unpack(self, qweight: torch.Tensor, qzeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [N, K], z [N, G]) from the checkpoint's packed tensors."""
        raise NotImplementedError

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> "CheckpointInt4Config":
        return cls(options.get("checkpoint") or {}, options.get("lm_head", "none"))


class GptqConfig(CheckpointInt4Config):
    """`quant_method: gptq` (AutoGPTQ / GPTQModel, 4-bit, sym or asym, no act-order)."""

    name = "gptq"

    def __init__(self, checkpoint: dict[str, Any], lm_head: str = "none"):
        super().__init__(checkpoint, lm_head)
        self.zero_offset = 0 if checkpoint.get("checkpoint_format") == "gptq_v2" else 1

    def unpack(self, qweight: torch.Tensor, qzeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return gptq_unpack(qweight, qzeros, self.zero_offset)


class AwqConfig(CheckpointInt4Config):
    """`quant_method: awq` (AutoAWQ GEMM packing, 4-bit, with zero points)."""

    name = "awq"

    def __init__(self, checkpoint: dict[str, Any], lm_head: str = "none"):
        super().__init__(checkpoint, lm_head)
        version = str(checkpoint.get("version", "gemm")).lower()
        if version != "gemm":
            raise UnsupportedError(f"AWQ version {version!r} is not supported; only 'gemm' packing",
                                   param="quantization")
        if not checkpoint.get("zero_point", True):
            raise UnsupportedError("AWQ without zero points (zero_point: false) is not supported",
                                   param="quantization")

    def unpack(self, qweight: torch.Tensor, qzeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return awq_unpack_cols(qweight).t().contiguous(), awq_unpack_cols(qzeros).t().contiguous()


class CheckpointInt4Method(Int4LinearMethod):
    """Holds a layer's checkpoint tensors (fused projections by output rows) until all are loaded, then hands
    their exact (q, scale, zero) to the int4 method's storage."""

    def __init__(self, config: CheckpointInt4Config, group_size: int):
        super().__init__(group_size)
        self.config = config

    def create_weights(self, layer: "Linear", in_features: int, out_features: int, bias: bool) -> None:
        gptq = isinstance(self.config, GptqConfig)
        ckpt_groups = 1 if self.config.ckpt_group_size == -1 else -(-in_features // self.config.ckpt_group_size)
        words = _word_starts(layer)[-1]  # each projection's row count rounded up to whole words
        shapes = {"qweight": ((-(-in_features // 8), out_features) if gptq else (in_features, words)),
                  "qzeros": (ckpt_groups, words), "scales": (ckpt_groups, out_features)}
        for name, shape in shapes.items():
            p = nn.Parameter(torch.empty(shape, dtype=torch.int32 if name != "scales" else torch.float32),
                             requires_grad=False)
            p.loads_by_shard = True  # fused q/k/v and gate/up: one tensor per projection, along dim 1 here
            p.shard_unit = 8 if name != "scales" and (name == "qzeros" or not gptq) else 1
            setattr(layer, name, set_weight_loader(p, self._loader(layer)))
        if gptq:
            g_idx = nn.Parameter(torch.empty(in_features, dtype=torch.int32), requires_grad=False)
            g_idx.checkpoint_optional = True  # each projection's copy is checked when present, none is kept
            layer.g_idx = set_weight_loader(g_idx, self._check_g_idx(layer))
        self.create_bias(layer, out_features, bias)

    @staticmethod
    def _loader(layer: "Linear"):
        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Optional[int] = None) -> None:
            if shard_id is None:
                copy_checked(param.data, loaded)
                return
            if param.shard_unit == 1:
                cols = layer.shard_slice(shard_id)
            else:
                starts = _word_starts(layer)
                cols = slice(starts[shard_id], starts[shard_id + 1])
            copy_checked(param.data[:, cols], loaded)
        return load

    def _check_g_idx(self, layer: "Linear"):
        gs = layer.in_features if self.config.ckpt_group_size == -1 else self.config.ckpt_group_size

        def check(param: nn.Parameter, loaded: torch.Tensor, shard_id: Optional[int] = None) -> None:
            trivial = torch.arange(layer.in_features, dtype=torch.int64) // gs
            if tuple(loaded.shape) != (layer.in_features,) or not torch.equal(loaded.to(torch.int64), trivial):
                raise UnsupportedError("GPTQ act-order (desc_act with a g_idx that permutes the groups) is not "
                                       "supported; re-quantize with desc_act: false", param="model")
        return check

    def process_weights_after_loading(self, layer: "Linear") -> None:
        q, z = self.config.unpack(layer.qweight.data, layer.qzeros.data)
        z = _drop_pad_rows(layer, z)
        if q.shape[0] != layer.out_features:  # AWQ packs rows too
            q = _drop_pad_rows(layer, q)
        scale = layer.scales.data.float().t()
        ckpt_gs = layer.in_features if self.config.ckpt_group_size == -1 else self.config.ckpt_group_size
        padded = scale.shape[1] * ckpt_gs  # inputs up to whole groups: the int4 storage pads them with zeros
        q = torch.nn.functional.pad(q[:, :layer.in_features], (0, padded - layer.in_features))
        repeat = ckpt_gs // self.group_size
        scale = scale.repeat_interleave(repeat, dim=1).contiguous()
        zero = scale * (8 - z.float()).repeat_interleave(repeat, dim=1)
        for name in ("qweight", "qzeros", "scales", "g_idx"):
            if hasattr(layer, name):
                delattr(layer, name)
        self.store_quantized(layer, q, scale, zero)


def _word_starts(layer: "Linear") -> list[int]:
    """Where each projection's columns start in a tensor packed eight rows to a word (and the total)."""
    starts = [0]
    for n in layer.output_sizes:
        starts.append(starts[-1] + -(-n // 8))
    return starts


def _drop_pad_rows(layer: "Linear", t: torch.Tensor) -> torch.Tensor:
    """Rows unpacked from words packed along the outputs, without each projection's padding to whole words."""
    starts = _word_starts(layer)
    if starts[-1] * 8 == layer.out_features:
        return t
    return torch.cat([t[8 * starts[i]:8 * starts[i] + n] for i, n in enumerate(layer.output_sizes)])


CHECKPOINT_METHODS: dict[str, type[CheckpointInt4Config]] = {"gptq": GptqConfig, "awq": AwqConfig}


def checkpoint_quantization(hf_config: dict[str, Any]) -> Optional[str]:
    """'gptq' or 'awq' when config.json says the checkpoint is so quantized; another method is refused."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method not in CHECKPOINT_METHODS:
        raise UnsupportedError(f"checkpoints quantized with {method or 'an unnamed method'!r} are not supported; "
                               f"supported: {', '.join(CHECKPOINT_METHODS)} (4-bit)", param="model")
    return method
