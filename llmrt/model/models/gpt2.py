"""GPT-2: learned positions, LayerNorm, fused c_attn stored in HF's Conv1D (transposed) layout."""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from llmrt.errors import UnsupportedError
from llmrt.model.layers.activation import get_activation
from llmrt.model.layers.attention import Attention
from llmrt.model.layers.embedding import Embedding, vocab_shard
from llmrt.model.layers.linear import Linear, split_evenly
from llmrt.model.layers.weights import CheckpointTensor
from llmrt.model.layers.norms import LayerNorm
from llmrt.model.models.base import CausalLM, StageMissingLayer
from llmrt.model.quantization import QuantizationConfig

_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


class GPT2Block(nn.Module):
    """ln_1 -> attention -> residual, ln_2 -> MLP -> residual."""

    def __init__(self, c: dict[str, Any], dtype: torch.dtype, quant: Optional[QuantizationConfig]):
        super().__init__()
        d, heads = c["n_embd"], c["n_head"]
        inner = c.get("n_inner") or 4 * d
        eps = c.get("layer_norm_epsilon", 1e-5)
        self.head_dim = d // heads
        q = split_evenly(d, "n_embd")  # each rank holds heads / tp heads of q, k and v
        self.heads = q.size // self.head_dim
        self.ln_1 = LayerNorm(d, eps)
        self.ln_2 = LayerNorm(d, eps)
        self.c_attn = Linear(d, [d, d, d], True, dtype, quant, parallel="column", shards=[q, q, q])
        self.attn_c_proj = Linear(d, [d], True, dtype, quant, parallel="row")
        self.c_fc = Linear(d, [inner], True, dtype, quant, parallel="column")
        self.mlp_c_proj = Linear(inner, [d], True, dtype, quant, parallel="row")
        self.attn = Attention(self.heads, self.heads, self.head_dim, self.head_dim ** -0.5)
        self.act = get_activation(c.get("activation_function", "gelu_new"))

    def forward(self, x: torch.Tensor, meta: Any) -> torch.Tensor:
        q, k, v = self.c_attn(self.ln_1(x)).view(-1, 3, self.heads, self.head_dim).unbind(1)
        x = x + self.attn_c_proj(self.attn(q, k, v, meta).reshape(x.shape[0], -1))
        return x + self.mlp_c_proj(self.act(self.c_fc(self.ln_2(x))))


class GPT2LMHeadModel(CausalLM):
    """GPT-2 with a tied LM head."""

    ignored_suffixes = (".attn.bias", ".attn.masked_bias")

    def __init__(self, hf_config: dict[str, Any], compute_dtype: torch.dtype, architecture: str = "GPT2LMHeadModel",
                 quant_config: Optional[QuantizationConfig] = None):
        super().__init__(hf_config, compute_dtype)
        c = hf_config
        if c.get("scale_attn_by_inverse_layer_idx") or c.get("add_cross_attention"):
            raise UnsupportedError("GPT-2 variants with scale_attn_by_inverse_layer_idx or cross attention are not supported")
        if c.get("scale_attn_weights") is False:
            raise UnsupportedError("GPT-2 with scale_attn_weights=false is not supported")
        first, last = self.stage.is_first, self.stage.is_last
        self.stage_layers = self.stage.layer_range(c["n_layer"])
        self.wte = Embedding(c["vocab_size"], c["n_embd"], compute_dtype, vocab_parallel=True) if first else None
        self.wpe = Embedding(c["n_positions"], c["n_embd"], compute_dtype) if first else None
        self.h = nn.ModuleList(GPT2Block(c, compute_dtype, quant_config) if i in self.stage_layers
                               else StageMissingLayer() for i in range(c["n_layer"]))
        self.ln_f = LayerNorm(c["n_embd"], c.get("layer_norm_epsilon", 1e-5)) if last else None
        self.lm_head = Linear(c["n_embd"], [c["vocab_size"]], False, compute_dtype, parallel="column",
                              shards=[vocab_shard(c["vocab_size"])],
                              quant_config=quant_config.lm_head_config() if quant_config else None
                              ) if last else None  # type: ignore[assignment]
        if first and last:
            self.lm_head.weight = self.wte.weight
        elif last:  # the tied table lives on the first stage: this stage reads its own copy
            self.checkpoint_alias = {"wte.weight": "lm_head.weight"}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any,
                carry: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = self.wte(input_ids) + self.wpe(positions) if carry is None else carry[0]
        for i in self.stage_layers:
            x = self.h[i](x, meta)
        return self.ln_f(x) if self.ln_f is not None else x.unsqueeze(0)

    def hf_to_ours(self, hf_name: str) -> Optional[str]:
        """Map 'transformer.h.0.attn.c_proj.weight' to 'h.0.attn_c_proj.weight'."""
        name = hf_name.removeprefix("transformer.")
        for src, dst in (("attn.c_attn", "c_attn"), ("attn.c_proj", "attn_c_proj"), ("mlp.c_fc", "c_fc"),
                         ("mlp.c_proj", "mlp_c_proj")):
            name = name.replace(src, dst)
        return name

    def transform_weight(self, hf_name: str, tensor: CheckpointTensor) -> CheckpointTensor:
        # HF's Conv1D stores [in, out]; our Linear wants [out, in] (a lazy view: a rank reads only its slice).
        return tensor.t() if hf_name.endswith(_CONV1D) else tensor

    def tied_parameters(self) -> dict[str, str]:
        return {"lm_head.weight": "wte.weight"} if self.stage.is_first and self.stage.is_last else {}
