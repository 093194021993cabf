"""A worker: one rank's device, its model shard (through its ModelRunner) and its KV-cache tensors."""
from __future__ import annotations

import logging
from typing import Optional

import torch

from llmrt.attention.kv_quant import allocate_kv, kv_bytes_per_token
from llmrt.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from llmrt.engine.memory_plan import MemoryPlan, kv_budget_bytes, num_kv_blocks
from llmrt.engine.step import BlockMoves, ModelRunnerOutput, SchedulerOutput, StepInput
from llmrt.distributed.parallel_state import Communicator, building_shard, rank_device
from llmrt.distributed.pipeline import PipeComm, PPStage, building_stage
from llmrt.errors import OutOfMemoryError
from llmrt.hardware import device_memory_free_total, tune_cpu_allocator
from llmrt.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

KVCache = list[tuple[torch.Tensor, torch.Tensor]]  # per attention layer: (K, V) [blocks, block_size, heads, dim]


class Worker:
    """Owns a device and everything on it: the model, the KV blocks and the host swap pool."""

    def __init__(self, config: EngineConfig, rank: int = 0, device: Optional[torch.device] = None,
                 comm: Optional[Communicator] = None, pipe: Optional[PipeComm] = None):
        """`comm`: the tensor-parallel group's communicator when layers are split (this rank is `comm.rank` of
        its size); `pipe`: the links to the other pipeline stages when the layers are cut into stages."""
        self.config = config
        self.rank = rank
        self.comm = comm
        self.pipe = pipe
        self.device = device or rank_device(config.device, rank)
        if self.device.type == "cpu":
            tune_cpu_allocator()
        torch.manual_seed(config.model.seed)
        stage = pipe.stage if pipe is not None else PPStage()
        with building_shard(comm.rank if comm else 0, comm.size if comm else 1, comm), \
                building_stage(stage.index, stage.size):
            self.model_runner = ModelRunner(config, self.device)
        self.model_runner.pipe = pipe
        self.block_size = config.cache.block_size
        self.kv_dtype = config.model.torch_dtype
        self.kv_cache_dtype = config.cache.kv_cache_dtype  # auto (the model dtype) | int8 | fp8
        self.kv_caches: KVCache = []
        self.host_cache: KVCache = []  # swap space, same layout in host memory
        self.memory: Optional[MemoryPlan] = None

    # -- start-up --------------------------------------------------------------------------------------
    def initialize_cache(self) -> MemoryPlan:
        """Size the KV cache from the memory budget left after weights and activations, and allocate it."""
        cc = self.config.cache
        runner = self.model_runner
        weights = sum(r.weights_bytes() for r in self._kv_runners)
        if self.device.type == "cpu":
            # The CPU KV budget is a fixed size, not what activations leave over: the peak only goes in the report,
            # so it is estimated (memory_plan's formula, checked against a measurement in tests/test_memory_plan)
            # rather than measured by a max-size forward pass under a dispatch-mode tracker, seconds of start-up.
            activation = runner.estimate_activation_peak(self.config.parallel.tensor_parallel_size)
        else:
            activation = runner.profile_activation_peak(lambda n: self._allocate(n, runner))
        # A draft model's KV shares the target's blocks: each block holds both.
        per_token = sum(self._bytes_per_token(r) for r in self._kv_runners)
        block_bytes = per_token * self.block_size
        if cc.num_gpu_blocks_override is not None:
            num_blocks = cc.num_gpu_blocks_override
        elif self.device.type == "cuda":
            # Blocks torch's allocator caches with no tensor in them (the activation probe's, a closed engine's
            # KV cache) are free for this cache: hand them back first, or they would read as used by others.
            torch.cuda.empty_cache()
            free, total = device_memory_free_total(self.device)
            # What this process's allocator does not hold: other processes and the CUDA context.
            used_elsewhere = max(0, total - free - torch.cuda.memory_reserved(self.device))
            budget = kv_budget_bytes(total, cc.gpu_memory_utilization, weights, activation, used_elsewhere, free)
            num_blocks = num_kv_blocks(budget, per_token, self.block_size)
        else:
            budget = cc.kv_cache_memory if cc.kv_cache_memory is not None else DEFAULT_CPU_KV_CACHE_BYTES
            num_blocks = num_kv_blocks(budget, per_token, self.block_size)
            if cc.kv_cache_memory is None:
                # A default budget never allocates more than the scheduler could ever fill.
                useful = self.config.scheduler.max_num_seqs * -(-self.config.model.max_model_len // self.block_size)
                num_blocks = min(num_blocks, useful)
        # Every rank must hold the same blocks (each for its own layers): the smallest budget decides.
        if self.pipe is not None:
            num_blocks = self.pipe.all_min(num_blocks)
        elif self.comm is not None:
            num_blocks = self.comm.all_min(num_blocks)
        if num_blocks < 1:
            raise_oom(weights, activation, block_bytes)
        self.kv_caches = []
        for r in self._kv_runners:
            caches = self._allocate(num_blocks, r)
            r.bind_kv_cache(caches)
            self.kv_caches += caches
        max_len = int(self.config.model.max_model_len)
        contexts = tuple(c for c in (1024, 4096, 16384) if c < max_len) + (max_len,)
        self.memory = MemoryPlan(weights, activation, per_token, self.block_size, num_blocks, contexts,
                                 kv_format=self._kv_format_name())
        logger.info(self.memory.describe())
        return self.memory

    @property
    def _kv_runners(self) -> list[ModelRunner]:
        """Every model with KV in the cache: the target, and a draft model when one proposes."""
        draft = getattr(self.model_runner.proposer, "runner", None)
        return [self.model_runner] + ([draft] if draft is not None else [])

    def _bytes_per_token(self, runner: ModelRunner) -> int:
        return kv_bytes_per_token(runner.kv_spec, self.kv_dtype, self.kv_cache_dtype)

    def _kv_format_name(self) -> str:
        if self.kv_cache_dtype == "auto":
            return str(self.kv_dtype).replace("torch.", "")
        return f"{self.kv_cache_dtype} + float32 scale per token and head"

    def _allocate(self, num_blocks: int, runner: ModelRunner, device: Optional[torch.device] = None,
                  pin: bool = False) -> KVCache:
        # The host swap pool is torch.empty: untouched pages cost nothing until a block is swapped out.
        return allocate_kv(runner.kv_spec, num_blocks, self.block_size, self.kv_dtype, self.kv_cache_dtype,
                           self.device, host=device is not None, pin=pin)

    def initialize_host_cache(self, swap_bytes: int) -> int:
        """Allocate the host-memory pool swapped-out KV blocks go to (pinned on CUDA); return its block count."""
        per_block = sum(self._bytes_per_token(r) for r in self._kv_runners) * self.block_size
        num = swap_bytes // per_block
        pin = self.device.type == "cuda"
        self.host_cache = [c for r in self._kv_runners for c in self._allocate(num, r, torch.device("cpu"), pin)]
        logger.info("swap space: %d host blocks (%.1f MiB)", num, num * per_block / (1 << 20))
        return num

    # -- one step --------------------------------------------------------------------------------------
    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        """Run the step's forward pass and sampling (its block moves must have run first)."""
        return self.model_runner.execute(step)

    def execute_shard(self, inp: StepInput) -> None:
        """A rank other than 0: the block moves rank 0 made, then this rank's part of the forward pass."""
        for moves in inp.block_moves:
            self.move_blocks(moves)
        self.model_runner.forward(inp)

    def move_blocks(self, step: "SchedulerOutput | BlockMoves") -> None:
        """Swap-outs, then copy-on-write copies, then swap-ins: a block freed by a swap-out may be the
        destination of a copy or a swap-in in the same step."""
        if step.swap_out or step.block_copies or step.swap_in:  # most steps move nothing: skip inference mode
            self._move_blocks(step)

    @torch.inference_mode()
    def _move_blocks(self, step: "SchedulerOutput | BlockMoves") -> None:
        if step.swap_out:
            dev = torch.tensor([d for d, _ in step.swap_out], device=self.device)
            host = torch.tensor([h for _, h in step.swap_out])
            for (k, v), (hk, hv) in zip(self.kv_caches, self.host_cache):
                hk.index_copy_(0, host, k.index_select(0, dev).to("cpu"))
                hv.index_copy_(0, host, v.index_select(0, dev).to("cpu"))
        if step.block_copies:
            src = torch.tensor([s for s, _ in step.block_copies], device=self.device)
            dst = torch.tensor([d for _, d in step.block_copies], device=self.device)
            for k, v in self.kv_caches:
                k[dst] = k[src]
                v[dst] = v[src]
        if step.swap_in:
            host = torch.tensor([h for h, _ in step.swap_in])
            dev = torch.tensor([d for _, d in step.swap_in], device=self.device)
            for (k, v), (hk, hv) in zip(self.kv_caches, self.host_cache):
                k.index_copy_(0, dev, hk.index_select(0, host).to(self.device, non_blocking=True))
                v.index_copy_(0, dev, hv.index_select(0, host).to(self.device, non_blocking=True))


def raise_oom(weights: int, activation: int, block_bytes: int) -> None:
    """No room for even one KV block: say the numbers."""
    raise OutOfMemoryError(
        f"no memory left for the KV cache: weights {weights} B and activation peak {activation} B leave less "
        f"than one block ({block_bytes} B); raise --gpu-memory-utilization / --kv-cache-memory or lower "
        "--max-num-batched-tokens"
    )
