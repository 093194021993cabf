"""The Llama family: Llama 2/3, Mistral, Qwen2 (qkv bias), Qwen3 (q/k RMSNorm)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from llmrt.model.layers.activation import GatedActivation
from llmrt.model.layers.attention import Attention
from llmrt.distributed.parallel_state import tp_shard
from llmrt.model.layers.embedding import Embedding, vocab_shard
from llmrt.model.layers.linear import Linear, OutputShard, split_evenly
from llmrt.model.layers.norms import RMSNorm
from llmrt.model.layers.rotary import RotaryEmbedding, rope_parameters
from llmrt.model.models.base import CausalLM, StageMissingLayer
from llmrt.distributed.pipeline import pp_stage
from llmrt.model.quantization import QuantizationConfig


@dataclass(frozen=True)
class LlamaArch:
    """The handful of switches that tell the Llama-family members apart."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    eps: float
    act: str
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tied: bool
    max_positions: int
    sliding_windows: tuple[Optional[int], ...]

    @classmethod
    def from_hf(cls, c: dict[str, Any], architecture: str) -> "LlamaArch":
        """Read an HF config.json of one of the family's architectures."""
        heads = c["num_attention_heads"]
        layers = c["num_hidden_layers"]
        bias = bool(c.get("attention_bias", False))
        qwen2 = architecture == "Qwen2ForCausalLM"
        window = c.get("sliding_window")
        types = c.get("layer_types")
        if types:
            windows = tuple(window if t == "sliding_attention" else None for t in types)
        elif architecture == "MistralForCausalLM" and window:
            windows = (window,) * layers
        else:
            windows = (None,) * layers
        return cls(
            hidden=c["hidden_size"], intermediate=c["intermediate_size"], layers=layers, heads=heads,
            kv_heads=c.get("num_key_value_heads") or heads, head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            vocab=c["vocab_size"], eps=c.get("rms_norm_eps", 1e-6), act=c.get("hidden_act", "silu"),
            qkv_bias=bias or qwen2, o_bias=bias and not qwen2, mlp_bias=bool(c.get("mlp_bias", False)),
            qk_norm=architecture == "Qwen3ForCausalLM", tied=bool(c.get("tie_word_embeddings", False)),
            max_positions=c.get("max_position_embeddings", 2048), sliding_windows=windows,
        )


def kv_head_shard(kv_heads: int, head_dim: int) -> OutputShard:
    """This rank's KV heads: an equal share, or (fewer KV heads than ranks) one head shared by tp / kv ranks."""
    tp = tp_shard()
    if kv_heads >= tp.size:
        return split_evenly(kv_heads * head_dim, "KV heads x head_dim")
    head = tp.rank // (tp.size // kv_heads)
    return OutputShard(head * head_dim, head_dim, head_dim)


class LlamaAttention(nn.Module):
    """Fused QKV projection, optional q/k norm, RoPE, paged attention, output projection.

    Tensor parallel: each rank holds heads / tp query heads and their KV heads (column-parallel qkv_proj) and
    the matching input columns of o_proj (row-parallel, one all-reduce)."""

    def __init__(self, a: LlamaArch, rotary: RotaryEmbedding, window: Optional[int], dtype: torch.dtype,
                 quant: Optional[QuantizationConfig]):
        super().__init__()
        self.a = a
        q = split_evenly(a.heads * a.head_dim, "query heads x head_dim")
        kv = kv_head_shard(a.kv_heads, a.head_dim)
        self.heads, self.kv_heads = q.size // a.head_dim, kv.size // a.head_dim
        self.q_size, self.kv_size = q.size, kv.size
        self.qkv_proj = Linear(a.hidden, [a.heads * a.head_dim, a.kv_heads * a.head_dim, a.kv_heads * a.head_dim],
                               a.qkv_bias, dtype, quant, parallel="column", shards=[q, kv, kv])
        self.o_proj = Linear(a.heads * a.head_dim, [a.hidden], a.o_bias, dtype, quant, parallel="row")
        if a.qk_norm:
            self.q_norm = RMSNorm(a.head_dim, a.eps)
            self.k_norm = RMSNorm(a.head_dim, a.eps)
        self.rotary = rotary
        self.attn = Attention(self.heads, self.kv_heads, a.head_dim, a.head_dim ** -0.5, window)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: Any) -> torch.Tensor:
        # One view and one split (views into the projection, heads contiguous): 2 ops a layer instead of 4.
        q, k, v = self.qkv_proj(x).view(-1, self.heads + 2 * self.kv_heads, self.a.head_dim).split(
            [self.heads, self.kv_heads, self.kv_heads], dim=1)
        if self.a.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, meta).reshape(-1, self.q_size))


class LlamaMLP(nn.Module):
    """Gated MLP with gate and up projections fused into one matmul."""

    def __init__(self, a: LlamaArch, dtype: torch.dtype, quant: Optional[QuantizationConfig]):
        super().__init__()
        self.gate_up_proj = Linear(a.hidden, [a.intermediate, a.intermediate], a.mlp_bias, dtype, quant,
                                   parallel="column")
        self.down_proj = Linear(a.intermediate, [a.hidden], a.mlp_bias, dtype, quant, parallel="row")
        self.act = GatedActivation(a.act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with the residual carried alongside."""

    def __init__(self, a: LlamaArch, rotary: RotaryEmbedding, window: Optional[int], dtype: torch.dtype,
                 quant: Optional[QuantizationConfig]):
        super().__init__()
        self.self_attn = LlamaAttention(a, rotary, window, dtype, quant)
        self.mlp = LlamaMLP(a, dtype, quant)
        self.input_layernorm = RMSNorm(a.hidden, a.eps)
        self.post_attention_layernorm = RMSNorm(a.hidden, a.eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: Optional[torch.Tensor],
                meta: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    """Embedding, decoder stack and final norm (a pipeline stage builds only its share: the embedding on the first,
    the norm on the last, its layers in between)."""

    def __init__(self, a: LlamaArch, rope: dict[str, Any], dtype: torch.dtype, quant: Optional[QuantizationConfig]):
        super().__init__()
        stage = pp_stage()
        self.stage_layers = stage.layer_range(a.layers)
        self.embed_tokens = Embedding(a.vocab, a.hidden, dtype, vocab_parallel=True) if stage.is_first else None
        rotary = RotaryEmbedding(a.head_dim, a.max_positions, rope)
        self.layers = nn.ModuleList(LlamaDecoderLayer(a, rotary, a.sliding_windows[i], dtype, quant)
                                    if i in self.stage_layers else StageMissingLayer() for i in range(a.layers))
        self.norm = RMSNorm(a.hidden, a.eps) if stage.is_last else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any,
                carry: Optional[torch.Tensor] = None) -> torch.Tensor:
        x, residual = (self.embed_tokens(input_ids), None) if carry is None else (carry[0], carry[1])
        for i in self.stage_layers:
            x, residual = self.layers[i](positions, x, residual, meta)
        if self.norm is None:  # the next stage continues from the hidden state and the residual
            return torch.stack([x, residual])
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(CausalLM):
    """Llama, Mistral, Qwen2 and Qwen3 causal LMs (they differ only in LlamaArch switches)."""

    packed_modules = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }
    ignored_suffixes = ("rotary_emb.inv_freq",)
    carry_rows = 2  # the hidden state and the residual

    def __init__(self, hf_config: dict[str, Any], compute_dtype: torch.dtype, architecture: str = "LlamaForCausalLM",
                 quant_config: Optional[QuantizationConfig] = None):
        super().__init__(hf_config, compute_dtype)
        self.arch = LlamaArch.from_hf(hf_config, architecture)
        self.model = LlamaModel(self.arch, rope_parameters(hf_config), compute_dtype, quant_config)
        if self.stage.is_last:  # in the format the quantization config chooses for it (int8 or the model dtype)
            self.lm_head = Linear(self.arch.hidden, [self.arch.vocab], False, compute_dtype, parallel="column",
                                  shards=[vocab_shard(self.arch.vocab)],
                                  quant_config=quant_config.lm_head_config() if quant_config else None)
        else:
            self.lm_head = None  # type: ignore[assignment]
        if self.arch.tied and self.stage.is_last:
            if self.stage.is_first:
                self.lm_head.weight = self.model.embed_tokens.weight
            else:  # the embedding lives on the first stage: this stage reads its own copy of the table
                self.checkpoint_alias = {"model.embed_tokens.weight": "lm_head.weight"}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any,
                carry: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.model(input_ids, positions, meta, carry)

    def tied_parameters(self) -> dict[str, str]:
        both = self.stage.is_first and self.stage.is_last
        return {"lm_head.weight": "model.embed_tokens.weight"} if self.arch.tied and both else {}
