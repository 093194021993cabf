"""Packed weights in huge-page mappings (llmrt/kernels/hugepages.py): advised MADV_HUGEPAGE, aligned, freed with their
tensors, off with LLMRT_HUGEPAGES=0, and the kernels' results the same whichever memory holds the weights."""
from __future__ import annotations

import gc
import os

import pytest
import torch

from llmrt.hardware import cpu_flags
from llmrt.kernels import build_for, hugepages, load
from llmrt.kernels.packed import PackedLinear
from llmrt.model.quantization.int4 import quantize_int4

THP = os.path.isdir("/sys/kernel/mm/transparent_hugepage") and hugepages.enabled()


def _mapping_flags(addr: int) -> set[str] | None:
    """The VmFlags of the mapping holding `addr` (None: no mapping holds it)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("VmFlags:"):
            return set(line.split()[1:])
    return None


@pytest.mark.skipif(not THP, reason="no transparent huge pages here")
def test_carved_tensors_sit_in_advised_mappings_and_go_with_them():
    small = [hugepages.empty((1000, 3), torch.bfloat16) for _ in range(3)]
    assert all(t.data_ptr() % hugepages.ALIGN == 0 for t in small)
    assert "hg" in _mapping_flags(small[0].data_ptr())  # MADV_HUGEPAGE
    assert small[1].data_ptr() >= small[0].data_ptr() + small[0].nbytes  # carved one after another, no overlap
    big = hugepages.empty((hugepages.CHUNK + 1,), torch.uint8)  # larger than a chunk: a mapping of its own
    addr = big.data_ptr()
    assert addr % hugepages.HUGE == 0 and "hg" in _mapping_flags(addr)
    big.fill_(7)
    view = big[-10:]
    del big
    gc.collect()
    assert _mapping_flags(addr) is not None and int(view[0]) == 7  # a view keeps it mapped
    del view
    gc.collect()
    assert _mapping_flags(addr) is None  # unmapped with its last tensor


def test_off_switch_gives_torch_allocations(monkeypatch):
    monkeypatch.setenv("LLMRT_HUGEPAGES", "0")
    assert not hugepages.enabled()
    t = hugepages.empty((4, 5), torch.float32)
    assert t.untyped_storage().nbytes() == t.nbytes  # its own storage, not a slice of a mapping
    assert hugepages.copy_of(torch.arange(6.0).view(2, 3)).tolist() == [[0, 1, 2], [3, 4, 5]]


@pytest.mark.skipif(build_for(cpu_flags()) is None, reason="no kernel build for this CPU")
def test_kernels_give_the_same_results_from_either_memory(monkeypatch):
    lib = load(build_for(cpu_flags()))
    torch.manual_seed(0)
    w = torch.randn(100, 96)
    q, s, z = quantize_int4(w, 32)
    x = torch.randn(3, 96).bfloat16()
    results = []
    for setting in ("1", "0"):
        monkeypatch.setenv("LLMRT_HUGEPAGES", setting)
        dense = PackedLinear.dense(lib, w.bfloat16())
        int4 = PackedLinear.int4(lib, q, s, z, 32, 96)
        results.append((dense.data.clone(), int4.data.clone(), int4.sz.clone(), dense(x), int4(x)))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_empty_shapes_and_alignment():
    assert hugepages.empty((0, 7), torch.bfloat16).shape == (0, 7)
    a, b = hugepages.empty((3,), torch.uint8), hugepages.empty((5,), torch.float32)
    assert b.data_ptr() % hugepages.ALIGN == 0 and a.data_ptr() % hugepages.ALIGN == 0


@pytest.mark.skipif(not hugepages.enabled(), reason="huge-page mappings are off here: nothing to fall back from")
def test_a_mapping_that_cannot_be_made_falls_back_to_torch(monkeypatch):
    def refuse(size):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(hugepages, "_map", refuse)
    monkeypatch.setattr(hugepages, "_carver", hugepages._Carver())  # no current chunk: the next request maps
    t = hugepages.empty((10, 10), torch.float32)
    assert t.shape == (10, 10) and t.untyped_storage().nbytes() == t.nbytes
