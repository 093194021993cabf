"""The attention-backend seam: an interface (metadata builder + forward) and a registry keyed by name and device."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, Optional

import torch

from llmrt.attention.metadata import CommonAttentionMetadata
from llmrt.errors import UnsupportedError

if TYPE_CHECKING:
    from llmrt.model.layers.attention import Attention


class AttentionBackend(ABC):
    """Computes paged attention for every layer of a step from the metadata it built for that step."""

    name: ClassVar[str]
    device_types: ClassVar[tuple[str, ...]]  # torch device types it runs on ("cpu", "cuda")
    priority: ClassVar[int] = 0  # `auto` takes the highest-priority backend that supports the device
    replayable: ClassVar[bool] = False  # whether graph_inputs can ever say yes (else no step graphs are built)

    @classmethod
    def supports(cls, device: torch.device) -> bool:
        """Whether this backend can run on `device` (installed kernels, compute capability)."""
        return device.type in cls.device_types

    @abstractmethod
    def build_metadata(self, common: CommonAttentionMetadata) -> Any:
        """This backend's metadata for one step; built once, shared by every layer."""

    def graph_inputs(self, meta: Any, kv_cache_dtype: torch.dtype,
                     compute_dtype: torch.dtype) -> Optional[list[torch.Tensor]]:
        """For a step a recording may replay (llmrt/worker/step_graph.py): the metadata's tensors that change from
        step to step, everything else in it fixed for the batch size. None (the default): this step's attention
        depends on Python values of the metadata (shapes, lengths), so it must run eagerly."""
        return None

    @abstractmethod
    def forward(self, layer: "Attention", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any) -> torch.Tensor:
        """Write the new k/v into `layer`'s cache and return attention outputs [tokens, heads, head_dim]."""


ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {}


def register_attention_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    """Class decorator: make a backend selectable by its name."""
    ATTENTION_BACKENDS[cls.name] = cls
    return cls


def select_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """`auto`: the best backend for `device`; otherwise the named one, refused if it cannot run there."""
    if name == "auto":
        usable = [c for c in ATTENTION_BACKENDS.values() if c.supports(device)]
        if not usable:
            raise UnsupportedError(f"no attention backend supports device {device}")
        return max(usable, key=lambda c: c.priority)()
    cls = ATTENTION_BACKENDS.get(name)
    if cls is None:
        raise UnsupportedError(f"attention backend {name!r} is not known; known: auto, "
                               f"{', '.join(sorted(ATTENTION_BACKENDS))}", param="attention_backend")
    if not cls.supports(device):
        ok = [n for n, c in sorted(ATTENTION_BACKENDS.items()) if c.supports(device)]
        raise UnsupportedError(f"attention backend {name!r} does not run on {device}; usable there: "
                               f"{', '.join(ok) or 'none'}", param="attention_backend")
    return cls()
