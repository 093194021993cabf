"""Packed weights in transparent huge pages, so that a decode step's weight streams cross 2 MiB pages, not 4 KiB ones.

A 1-row GEMV streams its layer's weights from memory; with 4 KiB pages every page it enters is a TLB miss, and on a
virtual machine a miss walks two sets of page tables. Measured on a 2-core Zen 4 VM (the 124.7M model's 48 decoder
linears streamed, 2 threads, the same packed bytes in both layouts, alternating in one process): bf16 0.86-0.97x the
time, int8 0.92x, int4 0.92-0.95x (docs/performance.md, "thirteenth session"). The packed tensors are carved from
anonymous private mappings marked MADV_HUGEPAGE (Linux's `madvise` THP mode, the common default, backs only such
mappings with huge pages). Where the platform has no MADV_HUGEPAGE, or with LLMRT_HUGEPAGES=0, torch allocates them.

A mapping lives as long as any tensor carved from it (torch.frombuffer holds it); the carver keeps only the chunk it
is filling, so a model's weights are freed with the model except those in that chunk (at most CHUNK bytes, until
the chunk fills), and a chunk's untouched tail takes no memory.
"""
from __future__ import annotations

import mmap
import os
import threading
from typing import Optional, Sequence

import torch

CHUNK = 64 << 20  # bytes mapped at a time (requests over half of it get a mapping of their own)
HUGE = 2 << 20  # the huge page size the chunks are aligned to
ALIGN = 64  # each tensor's start: a cache line


def enabled() -> bool:
    """Whether packed weights go to huge-page mappings (Linux with MADV_HUGEPAGE, LLMRT_HUGEPAGES not 0/off)."""
    if os.environ.get("LLMRT_HUGEPAGES", "1").lower() in ("0", "off"):
        return False
    return hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_ANONYMOUS")


class _Carver:
    """Hands out aligned slices of the current mapping, mapping a new one when it is full."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._chunk: Optional[torch.Tensor] = None  # uint8 view of the mapping, starting at a huge-page boundary
        self._used = 0

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
        if nbytes > CHUNK // 2:  # a mapping of its own, unmapped with it (the current chunk stays current)
            return _map(-(-nbytes // HUGE) * HUGE)[:nbytes].view(dtype).view(tuple(shape))
        with self._lock:
            start = -(-self._used // ALIGN) * ALIGN
            if self._chunk is None or start + nbytes > self._chunk.numel():
                self._chunk, start = _map(CHUNK), 0
            self._used = start + nbytes
            return self._chunk[start:start + nbytes].view(dtype).view(tuple(shape))


def _map(size: int) -> torch.Tensor:
    """A private anonymous mapping of `size` bytes (plus room to align it to HUGE), advised MADV_HUGEPAGE."""
    mm = mmap.mmap(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mm, dtype=torch.uint8)
    skip = -whole.data_ptr() % HUGE
    try:
        mm.madvise(mmap.MADV_HUGEPAGE, skip, size)
    except OSError:  # e.g. THP compiled out: the mapping still works, with 4 KiB pages
        pass
    return whole[skip:skip + size]


_carver = _Carver()


def empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor for packed weights: in a huge-page mapping where enabled(), else torch's (also
    where the mapping cannot be made, e.g. under strict overcommit, which charges a chunk's whole size)."""
    if enabled() and torch.Size(shape).numel() > 0:
        try:
            return _carver.empty(shape, dtype)
        except OSError:
            pass
    return torch.empty(tuple(shape), dtype=dtype)


def copy_of(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values in a tensor from `empty` (contiguous)."""
    out = empty(t.shape, t.dtype)
    out.copy_(t)
    return out
