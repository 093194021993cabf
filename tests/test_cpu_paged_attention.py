"""The `cpu_paged` attention backend (decodes read the paged cache in place) against the `torch` reference."""
from __future__ import annotations

import contextlib

import random

import pytest
import torch

from llmrt import LLM, SamplingParams
from llmrt.attention import build_common_metadata, select_attention_backend
from llmrt.attention.cpu_paged import CpuPagedAttentionBackend, load_kernel
from llmrt.model.layers.attention import Attention



def test_the_kernel_builds():
    assert load_kernel() is not None  # a build failure shows here (load_kernel logs its error), never as a skip


def _decode_step(backend_name: str, kv_dtype: torch.dtype, window, seed: int = 0, lens=(1, 5, 17, 40, 9),
                 heads: int = 8, kv_heads: int = 2, dim: int = 32) -> torch.Tensor:
    """One decode step of sequences with contexts `lens` in scattered blocks, from caches already holding them."""
    g = torch.Generator().manual_seed(seed)
    bs = 4
    num_blocks = sum(-(-n // bs) for n in lens) + 8
    perm = random.Random(seed).sample(range(num_blocks), num_blocks)  # non-contiguous block ids
    tables, used = [], 0
    for n in lens:
        nb = -(-n // bs)
        tables.append(perm[used:used + nb])
        used += nb
    k_cache = torch.randn(num_blocks, bs, kv_heads, dim, generator=g).to(kv_dtype)
    v_cache = torch.randn(num_blocks, bs, kv_heads, dim, generator=g).to(kv_dtype)
    layer = Attention(heads, kv_heads, dim, dim ** -0.5, sliding_window=window)
    backend = select_attention_backend(backend_name, torch.device("cpu"))
    layer.bind(k_cache, v_cache, backend)
    positions = torch.tensor([n - 1 for n in lens])
    common = build_common_metadata(tables, [1] * len(lens), lens, positions, len(lens), bs, torch.device("cpu"))
    meta = backend.build_metadata(common)
    q = torch.randn(len(lens), heads, dim, generator=g)
    k = torch.randn(len(lens), kv_heads, dim, generator=g)
    v = torch.randn(len(lens), kv_heads, dim, generator=g)
    return layer(q, k, v, meta)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("window", [None, 6])
def test_kernel_matches_the_torch_backend(kv_dtype, window):
    ref = _decode_step("torch", kv_dtype, window)
    got = _decode_step("cpu_paged", kv_dtype, window)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("dim", [64, 24])
def test_many_sequences_take_whole_sequence_units(kv_dtype, dim):
    """With many sequences the kernel gives each thread whole sequences (all KV heads, token by token), with few
    one (sequence, KV head) each; dims not a multiple of the vector width take the reference loop: all agree with
    the torch backend."""
    lens = [random.Random(i).randint(1, 70) for i in range(40)]
    for threads in (1, 2):
        with _threads(threads):
            ref = _decode_step("torch", kv_dtype, None, lens=lens, heads=12, kv_heads=4, dim=dim)
            got = _decode_step("cpu_paged", kv_dtype, None, lens=lens, heads=12, kv_heads=4, dim=dim)
            few_ref = _decode_step("torch", kv_dtype, None, lens=lens[:3], heads=12, kv_heads=4, dim=dim)
            few = _decode_step("cpu_paged", kv_dtype, None, lens=lens[:3], heads=12, kv_heads=4, dim=dim)
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(few, few_ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_a_sequences_result_does_not_depend_on_the_batch(kv_dtype):
    """Whole-sequence units (many sequences) and per-head units (few) compute each sequence bitwise alike, so
    micro-batching or batch composition cannot move a token's logprobs."""
    g = torch.Generator().manual_seed(5)
    n, heads, kv_heads, dim, bs = 24, 12, 4, 64, 4
    lens = torch.tensor([random.Random(i).randint(1, 60) for i in range(n)])
    width = 15
    tables = torch.randperm(n * width, generator=g).view(n, width)
    k_cache = torch.randn(n * width, bs, kv_heads, dim, generator=g).to(kv_dtype)
    v_cache = torch.randn(n * width, bs, kv_heads, dim, generator=g).to(kv_dtype)
    q = torch.randn(n, heads, dim, generator=g)
    kernel = load_kernel().decode
    with _threads(2):
        whole = kernel(q, k_cache, v_cache, tables, lens, dim ** -0.5, 0)
    for threads in (1, 2, 3):  # per-head units below 4 sequences a thread, whole ones from there
        with _threads(threads):
            for size in (1, 2, 12):
                part = torch.cat([kernel(q[i:i + size], k_cache, v_cache, tables[i:i + size], lens[i:i + size],
                                         dim ** -0.5, 0) for i in range(0, n, size)])
                assert torch.equal(whole, part), (threads, size)


@contextlib.contextmanager
def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_kernel_reads_bf16_and_strided_queries_as_their_float_copies():
    # The decode path hands the kernel q as a bf16 view into the qkv projection (tokens strided): the result must
    # be the float-copy path's, rounded once to bf16.
    g = torch.Generator().manual_seed(3)
    n, heads, kv_heads, dim, bs, blocks = 3, 6, 2, 16, 4, 8
    k_cache = torch.randn(blocks, bs, kv_heads, dim, generator=g).to(torch.bfloat16)
    v_cache = torch.randn(blocks, bs, kv_heads, dim, generator=g).to(torch.bfloat16)
    tables = torch.tensor([[3, 1], [0, 5], [7, 2]])
    lens = torch.tensor([5, 8, 2])
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=g).to(torch.bfloat16)
    q = qkv[:, :heads * dim].view(n, heads, dim)
    assert not q.is_contiguous()
    kernel = load_kernel().decode
    got = kernel(q, k_cache, v_cache, tables, lens, dim ** -0.5, 0)
    want = kernel(q.float().contiguous(), k_cache, v_cache, tables, lens, dim ** -0.5, 0).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=1)


@pytest.mark.parametrize("arch", ["llama3", "mistral", "gpt2"])
def test_greedy_tokens_unchanged_in_float32(arch, checkpoints):
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(2, 40))] for _ in range(6)]
    outs = {}
    for name in ("torch", "cpu_paged"):
        llm = LLM(str(checkpoints[arch]), dtype="float32", block_size=4, max_num_batched_tokens=32, max_num_seqs=8,
                  attention_backend=name)
        outs[name] = [o.outputs[0] for o in llm.generate(prompts, GREEDY)]
    for a, b in zip(outs["torch"], outs["cpu_paged"]):
        assert a.token_ids == b.token_ids
        assert max(abs(x[t] - y[t]) for x, y, t in zip(a.logprobs, b.logprobs, a.token_ids)) < 1e-4


def test_auto_picks_it_on_cpu_and_the_switch_turns_it_off(monkeypatch):
    assert select_attention_backend("auto", torch.device("cpu")).name == "cpu_paged"
    monkeypatch.setenv("LLMRT_ATTENTION_KERNEL", "0")
    load_kernel.cache_clear()
    try:
        assert not CpuPagedAttentionBackend.supports(torch.device("cpu"))
        assert select_attention_backend("auto", torch.device("cpu")).name == "torch"
    finally:
        monkeypatch.delenv("LLMRT_ATTENTION_KERNEL")
        load_kernel.cache_clear()


def test_cpu_kv_cache_is_zeroed_memory_taken_on_first_touch():
    from llmrt.attention.kv_quant import allocate_kv
    from llmrt.model.models.base import KVCacheSpec

    for dtype, kind in ((torch.float32, "auto"), (torch.bfloat16, "auto"), (torch.float32, "int8")):
        (k, v), _ = allocate_kv(KVCacheSpec(2, 2, 8), 64, 4, dtype, kind, torch.device("cpu"))
        assert k.shape[:3] == (64, 4, 2) and k.is_contiguous() and k.data_ptr() != v.data_ptr()
        assert not k.any() and not v.any()
        k[3] = 1
        assert int(k.count_nonzero()) == k[3].numel() and not v.any()
    # "on first touch": a 256 MiB cache adds next to nothing to the resident set until blocks are written
    # (torch.zeros would add all of it); writing one layer's K adds about that layer's K.
    import psutil
    proc = psutil.Process()
    before = proc.memory_info().rss
    layers = allocate_kv(KVCacheSpec(4, 8, 64), 1024, 16, torch.float32, "auto", torch.device("cpu"))
    size = sum(t.numel() * t.element_size() for kv in layers for t in kv)
    assert size == 256 << 20  # 4 layers x (K, V): one layer's K is an eighth
    assert proc.memory_info().rss - before < size // 16
    layers[0][0].fill_(1.0)
    grown = proc.memory_info().rss - before
    assert size // 8 * 0.9 < grown < size // 8 + size // 16


def test_decode_only_steps_get_the_same_positions_and_slots_as_in_a_mixed_step():
    """A step of one new token per sequence takes the list path (positions, slots); the same decodes followed by
    a prefill span take the batched one: the decodes' positions and slots must agree."""
    from llmrt.engine.step import StepInput

    bs = 4
    tables = [[7, 2], [5], [9, 3, 11, 1], [0]]
    lens = [6, 1, 16, 4]
    decodes = StepInput([1] * 4, tables, [1] * 4, lens, 4, [0, 1, 2, 3])
    mixed = StepInput([1] * 9, tables + [[4, 6]], [1] * 4 + [5], lens + [7], 4, [0, 1, 2, 3, 8])
    pos, pos_mixed = decodes.positions(), mixed.positions()
    assert pos.tolist() == pos_mixed[:4].tolist() == [n - 1 for n in lens]
    one = build_common_metadata(tables, [1] * 4, lens, pos, 4, bs, torch.device("cpu"))
    both = build_common_metadata(mixed.block_tables, mixed.query_lens, mixed.seq_lens, pos_mixed, 4, bs,
                                 torch.device("cpu"))
    assert torch.equal(one.slot_mapping, both.slot_mapping[:4])
    assert one.slot_mapping.tolist() == [2 * bs + 1, 5 * bs + 0, 1 * bs + 3, 0 * bs + 3]
    assert torch.equal(one.block_tables, both.block_tables[:4, :4])
    # the decode path's arrays are views of one tensor: each must still be its own array
    assert one.query_start_loc.tolist() == [0, 1, 2, 3, 4] and one.seq_lens.tolist() == lens
    assert one.block_tables.shape == (4, 4) and one.block_tables[2].tolist() == [9, 3, 11, 1]
    assert all(t.dtype == torch.long and t.is_contiguous() for t in
               (one.query_start_loc, one.seq_lens, one.block_tables, one.slot_mapping))


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16], ids=["src_f32", "src_bf16"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_cache_write_stores_strided_rows_like_index_copy(src_dtype, kv_dtype):
    g = torch.Generator().manual_seed(5)
    kv_heads, dim, n = 2, 16, 3
    qkv = torch.randn(n, (4 + 2 * kv_heads) * dim, generator=g).to(src_dtype)
    k = qkv[:, 4 * dim:(4 + kv_heads) * dim].view(n, kv_heads, dim)
    v = qkv[:, (4 + kv_heads) * dim:].view(n, kv_heads, dim)
    assert not k.is_contiguous()
    slots = torch.tensor([9, 0, 22])
    caches = [torch.randn(6, 4, kv_heads, dim, generator=g).to(kv_dtype) for _ in range(2)]
    want = [c.clone() for c in caches]
    want[0].view(-1, kv_heads, dim).index_copy_(0, slots, k.to(kv_dtype))
    want[1].view(-1, kv_heads, dim).index_copy_(0, slots, v.to(kv_dtype))
    load_kernel().cache_write(k, v, slots, caches[0], caches[1])
    assert torch.equal(caches[0], want[0]) and torch.equal(caches[1], want[1])
    with pytest.raises(RuntimeError, match="outside the cache"):
        load_kernel().cache_write(k, v, torch.tensor([9, 0, 24]), caches[0], caches[1])


def test_decode_write_is_the_write_then_the_decode():
    g = torch.Generator().manual_seed(7)
    heads, kv_heads, dim, bs = 6, 2, 32, 4
    tables = torch.tensor([[3, 1, 4], [0, 5, 2]])
    lens = torch.tensor([10, 7])
    slots = torch.tensor([1 * bs + 1, 5 * bs + 2])  # position len - 1 of each
    qkv = torch.randn(2, (heads + 2 * kv_heads) * dim, generator=g).to(torch.bfloat16)
    q = qkv[:, :heads * dim].view(2, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(2, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim:].view(2, kv_heads, dim)
    caches = [torch.randn(6, bs, kv_heads, dim, generator=g).to(torch.bfloat16) for _ in range(2)]
    ref = [c.clone() for c in caches]
    ops = load_kernel()
    ops.cache_write(k, v, slots, ref[0], ref[1])
    want = ops.decode(q, ref[0], ref[1], tables, lens, dim ** -0.5, 0)
    got = ops.decode_write(q, k, v, slots, caches[0], caches[1], tables, lens, dim ** -0.5, 0)
    assert torch.equal(got, want) and torch.equal(caches[0], ref[0]) and torch.equal(caches[1], ref[1])


@pytest.mark.parametrize("dim", [64, 128, 24], ids=["vector", "vector128", "scalar_tail"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 2), (8, 1), (12, 2)], ids=["g2", "g3", "g8", "g6"])
def test_kernel_against_float64_softmax_attention(dim, kv_dtype, heads, kv_heads):
    # Head dims that are and are not a multiple of the vector width, contexts longer than a vector of scores; GQA
    # groups whose V-pass accumulators fit the registers whole (g2 at dim 64) or a column chunk at a time.
    g = torch.Generator().manual_seed(11)
    bs = 16
    lens = torch.tensor([1, 37, 130])
    tables = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17],
                           [18, 19, 20, 21, 22, 23, 24, 25, 26]])
    k_cache = torch.randn(27, bs, kv_heads, dim, generator=g).to(kv_dtype)
    v_cache = torch.randn(27, bs, kv_heads, dim, generator=g).to(kv_dtype)
    q = torch.randn(3, heads, dim, generator=g)
    got = load_kernel().decode(q, k_cache, v_cache, tables, lens, dim ** -0.5, 0)
    for s in range(3):
        n = int(lens[s])
        ks = k_cache[tables[s]].reshape(-1, kv_heads, dim)[:n].double().repeat_interleave(heads // kv_heads, 1)
        vs = v_cache[tables[s]].reshape(-1, kv_heads, dim)[:n].double().repeat_interleave(heads // kv_heads, 1)
        p = torch.softmax(torch.einsum("hd,thd->ht", q[s].double(), ks) * dim ** -0.5, -1)
        torch.testing.assert_close(got[s].double(), torch.einsum("ht,thd->hd", p, vs), atol=2e-5, rtol=1e-4)
