"""Attention backends: the interface, the registry, and every backend (importing one registers it)."""
from llmrt.attention.base import (ATTENTION_BACKENDS, AttentionBackend, register_attention_backend,
                                  select_attention_backend)
from llmrt.attention.metadata import CommonAttentionMetadata, build_common_metadata
from llmrt.attention import torch_sdpa  # noqa: F401  (registers "torch")
from llmrt.attention import batch_invariant  # noqa: F401  (registers "batch_invariant", for --deterministic)
from llmrt.attention import cpu_paged  # noqa: F401  (registers "cpu_paged": CPU decodes from the paged cache)

__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "CommonAttentionMetadata", "build_common_metadata",
           "register_attention_backend", "select_attention_backend"]
