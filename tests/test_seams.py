"""The seams new capabilities plug into: executors, attention backends, linear methods, typed core messages.

Each test adds an implementation the way a later capability will (one class plus a registration) and checks
that the engine's outputs do not change.
"""
from __future__ import annotations

import json
import random
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from llmrt import LLM, SamplingParams
from llmrt.attention import ATTENTION_BACKENDS, build_common_metadata, register_attention_backend, select_attention_backend
from llmrt.attention.base import AttentionBackend
from llmrt.attention.cpu_paged import CpuPagedAttentionBackend
from llmrt.attention.metadata import CommonAttentionMetadata
from llmrt.config import EngineConfig
from llmrt.engine.admission import AdmissionController
from llmrt.engine.core import EngineCore
from llmrt.engine.messages import EngineStats, FinishReason, RequestRejected, StepResult
from llmrt.engine.step import ModelRunnerOutput, SchedulerOutput
from llmrt.errors import CapacityExceededError, InvalidRequestError, UnsupportedError
from llmrt.executor import EXECUTORS, UniProcExecutor, create_executor
from llmrt.model.layers.linear import Linear, LinearMethod
from llmrt.model.layers.weights import set_weight_loader
from llmrt.model.quantization import QUANTIZATION_METHODS, QuantizationConfig

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=1)


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(2, 40))] for _ in range(n)]


def _run(model_dir: Any, **options: Any) -> list[Any]:
    llm = LLM(str(model_dir), dtype="float32", block_size=4, max_num_batched_tokens=32, max_num_seqs=8, **options)
    outs = llm.generate(_prompts(6, seed=3), GREEDY)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    return [o.outputs[0] for o in outs]


def _assert_same(a: list[Any], b: list[Any]) -> None:
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        lx = [d[t] for d, t in zip(x.logprobs, x.token_ids)]
        ly = [d[t] for d, t in zip(y.logprobs, y.token_ids)]
        assert max(abs(p - q) for p, q in zip(lx, ly)) < 1e-4


# -- common attention metadata ---------------------------------------------------------------------------------
def test_common_metadata_is_the_flat_layout_kernels_expect():
    bs = 4
    tables = [[7], [2, 5], [9, 3, 1]]  # two decodes, then a 3-token chunk at positions 6..8
    positions = torch.tensor([2, 5, 6, 7, 8])
    meta = build_common_metadata(tables, [1, 1, 3], [3, 6, 9], positions, 2, bs, torch.device("cpu"))
    assert meta.query_start_loc.tolist() == [0, 1, 2, 5] and meta.num_tokens == 5
    assert meta.seq_lens.tolist() == [3, 6, 9] and meta.max_seq_len == 9 and meta.max_query_len == 3
    assert meta.block_tables.tolist() == [[7, 0, 0], [2, 5, 0], [9, 3, 1]]
    assert meta.slot_mapping.tolist() == [7 * 4 + 2, 5 * 4 + 1, 3 * 4 + 2, 3 * 4 + 3, 1 * 4 + 0]
    torch_meta = select_attention_backend("torch", torch.device("cpu")).build_metadata(meta)
    assert torch_meta.decode_block_tables.tolist() == [[7, 0], [2, 5]]  # only as wide as the decodes need
    assert [(s.start, s.length, s.context_len, s.block_table.tolist()) for s in torch_meta.prefills] == \
        [(2, 3, 9, [9, 3, 1])]


# -- attention backends ----------------------------------------------------------------------------------------
class PerSequenceBackend(AttentionBackend):
    """A second, deliberately different algorithm: every sequence (decode or prefill) on its own, reading its
    context from the cache through its block-table row, with an explicit causal mask."""

    name = "test-per-sequence"
    device_types = ("cpu",)

    def build_metadata(self, common: CommonAttentionMetadata) -> CommonAttentionMetadata:
        return common

    def forward(self, layer: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: CommonAttentionMetadata) -> torch.Tensor:
        heads, dim = layer.num_kv_heads, layer.head_dim
        layer.k_cache.view(-1, heads, dim).index_copy_(0, meta.slot_mapping, k)
        layer.v_cache.view(-1, heads, dim).index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        qsl = meta.query_start_loc_cpu
        for i in range(meta.num_seqs):
            ctx, rows = meta.seq_lens_cpu[i], slice(qsl[i], qsl[i + 1])
            blocks = meta.block_tables[i, : -(-ctx // meta.block_size)]
            ks = layer.k_cache.index_select(0, blocks).view(-1, heads, dim)[:ctx].transpose(0, 1)
            vs = layer.v_cache.index_select(0, blocks).view(-1, heads, dim)[:ctx].transpose(0, 1)
            n = qsl[i + 1] - qsl[i]
            q_pos = torch.arange(ctx - n, ctx)[:, None]
            k_pos = torch.arange(ctx)[None, :]
            mask = k_pos <= q_pos
            if layer.sliding_window is not None:
                mask &= k_pos > q_pos - layer.sliding_window
            o = F.scaled_dot_product_attention(q[rows].transpose(0, 1), ks, vs, attn_mask=mask, scale=layer.scale,
                                               enable_gqa=layer.gqa)
            out[rows] = o.transpose(0, 1)
        return out


@pytest.fixture
def per_sequence_backend():
    register_attention_backend(PerSequenceBackend)
    yield PerSequenceBackend.name
    ATTENTION_BACKENDS.pop(PerSequenceBackend.name)


@pytest.mark.parametrize("arch", ["llama3", "mistral", "gpt2"])
def test_a_new_attention_backend_plugs_in_without_touching_the_models(arch, checkpoints, per_sequence_backend):
    _assert_same(_run(checkpoints[arch], attention_backend="torch"),
                 _run(checkpoints[arch], attention_backend=per_sequence_backend))


def test_backend_selection(per_sequence_backend):
    cpu = torch.device("cpu")
    # The new one has torch's priority, and torch registered first; cpu_paged outranks both where its kernel builds.
    assert select_attention_backend("auto", cpu).name == ("cpu_paged" if CpuPagedAttentionBackend.supports(cpu)
                                                          else "torch")
    with pytest.raises(UnsupportedError, match="known: auto, batch_invariant, cpu_paged, test-per-sequence, torch"):
        select_attention_backend("flash", cpu)
    with pytest.raises(UnsupportedError, match="does not run on cuda"):
        select_attention_backend(per_sequence_backend, torch.device("cuda"))


# -- linear methods and weight loaders -------------------------------------------------------------------------
class TransposedLinearMethod(LinearMethod):
    """Stores W as [in, out] (a layout a packed kernel might want) under the checkpoint's name; its weight
    loader transposes each (fused) projection as it arrives."""

    def create_weights(self, layer: Linear, in_features: int, out_features: int, bias: bool) -> None:
        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Optional[int] = None) -> None:
            cols = slice(None) if shard_id is None else layer.shard_slice(shard_id)
            target = param.data[:, cols]
            assert target.shape == loaded.t().shape
            target.copy_(loaded.t())

        layer.weight = set_weight_loader(nn.Parameter(torch.empty(in_features, out_features), requires_grad=False),
                                           load)
        layer.bias = None
        if bias:
            layer.bias = set_weight_loader(nn.Parameter(torch.empty(out_features), requires_grad=False),
                                           layer.weight_loader)
        self.loaded_after = False

    def process_weights_after_loading(self, layer: Linear) -> None:
        self.loaded_after = True

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        assert self.loaded_after
        y = x @ layer.weight
        return y + layer.bias if layer.bias is not None else y


class TransposedConfig(QuantizationConfig):
    name = "test-transposed"

    def linear_method(self, layer: Linear) -> LinearMethod:
        return TransposedLinearMethod()


@pytest.fixture
def transposed_quantization():
    QUANTIZATION_METHODS[TransposedConfig.name] = TransposedConfig
    yield TransposedConfig.name
    QUANTIZATION_METHODS.pop(TransposedConfig.name)


@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])  # fused qkv with bias; GPT-2's Conv1D weights
def test_a_new_linear_method_reaches_every_projection(arch, checkpoints, transposed_quantization):
    llm = LLM(str(checkpoints[arch]), dtype="float32", quantization=transposed_quantization, block_size=4)
    model = llm.engine.executor.worker.model_runner.model
    linears = [m for name, m in model.named_modules() if isinstance(m, Linear) and name != "lm_head"]
    assert linears and all(isinstance(m.method, TransposedLinearMethod) for m in linears)
    assert isinstance(model.lm_head.method, LinearMethod) and not isinstance(model.lm_head.method, TransposedLinearMethod)
    _assert_same(_run(checkpoints[arch]), _run(checkpoints[arch], quantization=transposed_quantization))


def test_unknown_quantization_is_refused_before_loading(checkpoints):
    with pytest.raises(UnsupportedError, match="quantization 'int3' is not supported"):
        LLM(str(checkpoints["llama3"]), quantization="int3")


def test_every_parameter_owns_a_loader_that_knows_packing(checkpoints):
    llm = LLM(str(checkpoints["llama3"]), dtype="float32", block_size=4)
    loaded = llm.engine.executor.worker.model_runner.model.model.layers[0].self_attn.qkv_proj
    # A fresh layer of the loaded one's shape: after loading, CPU kernels keep the weights packed (no `weight`).
    from llmrt.model.layers.linear import Linear

    qkv = Linear(loaded.in_features, loaded.output_sizes)
    loader = qkv.weight.weight_loader
    parts = [torch.full((n, qkv.in_features), float(i)) for i, n in enumerate(qkv.output_sizes)]
    for i, part in enumerate(parts):
        loader(qkv.weight, part, i)
    assert torch.equal(qkv.weight.data, torch.cat(parts))
    with pytest.raises(ValueError, match="has shape"):
        loader(qkv.weight, parts[0][:, :3], 0)


# -- executors -------------------------------------------------------------------------------------------------
class CountingExecutor(UniProcExecutor):
    """An executor that records what it is asked to do, as a multi-process one would forward it."""

    name = "test-counting"

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self.steps: list[int] = []

    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(step.num_batched_tokens)
        return super().execute(step)


def test_the_core_is_handed_its_executor(checkpoints):
    EXECUTORS[CountingExecutor.name] = CountingExecutor
    try:
        config = EngineConfig.create(str(checkpoints["llama3"]), dtype="float32", block_size=4,
                                     max_num_batched_tokens=16, distributed_executor_backend="test-counting")
        executor = create_executor(config)
        assert isinstance(executor, CountingExecutor) and executor.worker.rank == 0
        core = EngineCore(config, executor)
        core.add_request("a", list(range(3, 40)), SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
        tokens = []
        while core.has_unfinished_requests():
            tokens += [t for o in core.step() for t in o.new_token_ids]
        assert len(tokens) == 5 and executor.steps == [16, 16, 5, 1, 1, 1, 1]  # 37-token prompt in chunks of 16
        ref = LLM(str(checkpoints["llama3"]), dtype="float32", block_size=4).generate(
            [list(range(3, 40))], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
        assert tokens == ref.outputs[0].token_ids
    finally:
        EXECUTORS.pop(CountingExecutor.name)


def test_unknown_executor_and_parallel_sizes_are_refused(checkpoints):
    config = EngineConfig.create(str(checkpoints["llama3"]), distributed_executor_backend="mpi")
    with pytest.raises(UnsupportedError, match="executor backend 'mpi' is not supported; supported: uni, mp, ray"):
        create_executor(config)
    with pytest.raises(UnsupportedError, match="uni executor runs one rank"):
        EngineConfig.create(str(checkpoints["llama3"]), tensor_parallel_size=2, distributed_executor_backend="uni")


# -- typed messages and the admission bound --------------------------------------------------------------------
def test_finish_reasons_are_an_enum_that_reads_as_its_string():
    assert FinishReason.STOP == "stop" and str(FinishReason.LENGTH) == "length" and f"{FinishReason.ABORT}" == "abort"
    assert json.dumps({"r": FinishReason.DEADLINE}) == '{"r": "deadline"}'


def _stats(waiting: int, steps: int) -> EngineStats:
    return EngineStats(num_running=4, num_waiting=waiting, waiting_tokens=10 * waiting, kv_blocks_total=100,
                       kv_blocks_free=50, num_steps=steps, last_step_tokens=4, num_preemptions=0)


def test_the_waiting_bound_holds_when_requests_arrive_mid_step():
    """The interleaving that broke the bound: a step's stats arrive before the core has taken in requests
    that were sent while that step ran. Counting unacknowledged requests keeps the bound exact."""
    ac = AdmissionController(max_waiting_requests=4, max_queue_delay_ms=None)
    for i in range(4):  # four requests sent while the core is busy with a step
        ac.admit(_stats(0, 1), 10)
        ac.submitted(f"r{i}", 10)
    ac.acknowledged([])  # that step's message: it ran before any of them arrived
    ac.observe_step(_stats(0, 2), 1.0)
    with pytest.raises(CapacityExceededError, match="4 requests are waiting"):
        ac.admit(_stats(0, 2), 10)
    ac.acknowledged(["r0", "r1", "r2", "r3"])  # the next step took them in; all still wait
    with pytest.raises(CapacityExceededError):
        ac.admit(_stats(4, 3), 10)
    ac.admit(_stats(3, 4), 10)  # one was scheduled: room for exactly one
    assert ac.num_unacknowledged == 0


def test_async_llm_counts_only_what_the_core_acknowledged():
    from llmrt.engine.async_llm import AsyncLLM

    eng = AsyncLLM(EngineConfig.create(None, dtype="float32"), max_waiting_requests=2)
    eng.admission.submitted("a", 5)
    eng.admission.submitted("b", 5)
    eng._on_message(StepResult([], _stats(0, 1), 1.0, acknowledged=[]))  # a step that did not see them
    with pytest.raises(CapacityExceededError):
        eng.admission.admit(eng._stats, 5)
    eng._on_message(RequestRejected("a", InvalidRequestError("bad")))  # a refusal acknowledges too
    eng._on_message(StepResult([], _stats(0, 2), 2.0, acknowledged=["b"]))  # b was taken in and scheduled
    eng.admission.admit(eng._stats, 5)
    assert eng.admission.num_unacknowledged == 0
