"""What every model family provides to the loader and the runner."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from llmrt.distributed.parallel_state import communicator
from llmrt.distributed.pipeline import PPStage, pp_stage
from llmrt.model.layers.attention import Attention
from llmrt.model.layers.weights import CheckpointTensor
from llmrt.model.layers.linear import Linear


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of the KV cache one model needs per token."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """K and V bytes for one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.empty((), dtype=dtype).element_size()


class StageMissingLayer(nn.Module):
    """Stands in for a layer another pipeline stage holds: no parameters, keeps the layer indices global."""

    def forward(self, *args: Any) -> Any:
        raise RuntimeError("this layer lives on another pipeline stage")


class CausalLM(nn.Module):
    """Base of llmrt's model families: flat tokens in, hidden states out, logits on request."""

    # HF projection name -> (our fused module name, shard index); see loader.load_weights.
    packed_modules: dict[str, tuple[str, int]] = {}
    # HF tensor-name suffixes that carry no weights (old buffers) and are skipped.
    ignored_suffixes: tuple[str, ...] = ()
    # Pipeline parallel: rows of [tokens, hidden] a stage hands the next (the hidden state, plus a residual).
    carry_rows: int = 1

    def __init__(self, hf_config: dict[str, Any], compute_dtype: torch.dtype):
        super().__init__()
        self.hf_config = hf_config
        self.compute_dtype = compute_dtype
        self.lm_head: Linear
        self.comm = communicator()  # the vocabulary-parallel head's logits are gathered through it
        self.stage: PPStage = pp_stage()
        # Pipeline parallel: our parameter name a checkpoint tensor loads into instead (a tied head on a last
        # stage without the embedding reads the embedding's tensor).
        self.checkpoint_alias: dict[str, str] = {}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any,
                carry: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Hidden states after the final norm; on a pipeline stage other than the last, the [carry_rows, tokens,
        hidden] carry for the next stage (`carry`: the previous stage's, None on the first)."""
        raise NotImplementedError

    def held_elsewhere(self, name: str) -> bool:
        """True when parameter `name` belongs to another pipeline stage (its module is absent here)."""
        obj: Any = self
        for part in name.split(".")[:-1]:
            obj = getattr(obj, part, None)
            if obj is None or isinstance(obj, StageMissingLayer):
                return True
        return False

    def compute_logits(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """Float32 logits for the given hidden states. Tensor parallel: every rank computes its vocabulary
        slice and rank 0 gathers them (other ranks get None)."""
        logits = self.lm_head(hidden).float()
        if self.comm is None:
            return logits
        logits = self.comm.gather_to_first(logits)
        return logits[..., :self.lm_head.full_output_sizes[0]] if logits is not None else None

    def kv_cache_spec(self) -> KVCacheSpec:
        """Per-token KV shape."""
        attn = self.attention_layers()
        return KVCacheSpec(len(attn), attn[0].num_kv_heads, attn[0].head_dim)

    def attention_layers(self) -> list[Attention]:
        """Attention modules in layer order (the runner binds their cache tensors)."""
        return [m for m in self.modules() if isinstance(m, Attention)]

    def transform_weight(self, hf_name: str, tensor: CheckpointTensor) -> CheckpointTensor:
        """Adapt a checkpoint tensor to our layout (identity by default)."""
        return tensor

    def tied_parameters(self) -> dict[str, str]:
        """Our parameter name -> the name it shares storage with (tied embeddings)."""
        return {}
