"""A model driven outside the engine, one sequence at a time (the quality bench, GPTQ calibration): a fresh paged
KV cache bound to its attention layers, and the forward arguments of one prefill chunk."""
from __future__ import annotations

from typing import Any

import torch

from llmrt.attention import build_common_metadata, select_attention_backend
from llmrt.attention.kv_quant import allocate_kv


def bind_fresh_kv(model: torch.nn.Module, blocks: int, block_size: int, dtype: torch.dtype,
                  kv_cache_dtype: str = "auto") -> Any:
    """A fresh paged KV cache of `blocks` blocks bound to every attention layer of `model` (on its device), with
    the torch attention backend, which it returns."""
    device = next(model.parameters()).device
    backend = select_attention_backend("torch", device)
    caches = allocate_kv(model.kv_cache_spec(), blocks, block_size, dtype, kv_cache_dtype, device)
    for layer, (k, v) in zip(model.attention_layers(), caches):
        layer.bind(k, v, backend)
    return backend


def chunk_inputs(ids: list[int], start: int, table: list[int], block_size: int, backend: Any,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """The forward arguments of one prefill chunk of a sequence: its tokens `ids` at positions start.., the
    sequence's KV in blocks `table`."""
    pos = torch.arange(start, start + len(ids))
    common = build_common_metadata([table], [len(ids)], [start + len(ids)], pos, 0, block_size, device)
    return torch.tensor(ids, device=device), pos.to(device), backend.build_metadata(common)
