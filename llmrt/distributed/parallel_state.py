"""A rank's place in the tensor-parallel group, and the collectives the model layers call.

`init_distributed` joins the group and returns its `Communicator`; the worker builds its model inside
`building_shard(rank, size, comm)`, and each split layer keeps the shard it was built as and that communicator.
Outside that block layers build whole, so an unsplit engine can share the process with a split one.
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TPShard:
    """Which slice of every split layer this process builds: rank `rank` of `size`."""

    rank: int = 0
    size: int = 1


@dataclass
class CollectiveStats:
    """Time spent inside collectives and bytes they moved, since the last `take_stats()`."""

    seconds: float = 0.0
    bytes: int = 0
    calls: int = 0
    _events: list = field(default_factory=list, repr=False)  # CUDA (start, end) pairs resolved at take time


# Upper bounds (seconds) of the per-step collective-time histogram (/metrics llmrt_collective_seconds).
COLLECTIVE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


@dataclass
class CollectiveTotals:
    """Rank 0's collective figures summed over steps (the engine core keeps one)."""

    bucket_counts: list[int] = field(default_factory=lambda: [0] * len(COLLECTIVE_BUCKETS))
    seconds: float = 0.0
    steps: int = 0
    step_seconds: float = 0.0
    bytes: int = 0
    tokens: int = 0

    def observe(self, seconds: float, nbytes: int, step_seconds: float, tokens: int) -> None:
        """Add one step."""
        for i, bound in enumerate(COLLECTIVE_BUCKETS):
            if seconds <= bound:
                self.bucket_counts[i] += 1
        self.seconds += seconds
        self.steps += 1
        self.step_seconds += step_seconds
        self.bytes += nbytes
        self.tokens += tokens


_SHARD = TPShard()
_COMM: Optional["Communicator"] = None


def tp_shard() -> TPShard:
    """The shard layers built now belong to (rank 0 of 1 outside tensor parallelism)."""
    return _SHARD


@contextlib.contextmanager
def building_shard(rank: int, size: int, comm: Optional["Communicator"] = None) -> Iterator[None]:
    """Build layers as rank `rank` of `size`, talking through `comm` (None: `llmrt plan` sizing one rank's
    model on the meta device)."""
    global _SHARD, _COMM
    old = _SHARD, _COMM
    _SHARD, _COMM = TPShard(rank, size), comm
    try:
        yield
    finally:
        _SHARD, _COMM = old


class Communicator:
    """The tensor-parallel group of this process: timed all-reduce and gather-to-rank-0."""

    def __init__(self, step_group: Optional[dist.ProcessGroup], rank: int, size: int, device: torch.device):
        # Start-up (loading, profiling) runs on the default group and its long timeout; steps on `step_group`.
        self.group: Optional[dist.ProcessGroup] = None
        self.step_group = step_group
        self.rank, self.size, self.device = rank, size, device
        self.stats = CollectiveStats()

    def use_step_timeout(self) -> None:
        """From now on collectives fail after the step timeout (called by every rank before its first step)."""
        self.group = self.step_group

    @contextlib.contextmanager
    def _timed(self, nbytes: int) -> Iterator[None]:
        self.stats.calls += 1
        self.stats.bytes += nbytes
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.stats._events.append((start, end))
            return
        t0 = time.perf_counter()
        yield
        self.stats.seconds += time.perf_counter() - t0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place; returns it."""
        with self._timed(t.numel() * t.element_size()):
            dist.all_reduce(t, group=self.group)
        return t

    def gather_to_first(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        """Rank 0: every rank's `t` concatenated along the last dim (rank order); other ranks: None."""
        parts = [torch.empty_like(t) for _ in range(self.size)] if self.rank == 0 else None
        with self._timed(t.numel() * t.element_size()):
            dist.gather(t.contiguous(), parts, group_dst=0, group=self.group)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def all_min(self, value: int) -> int:
        """The smallest `value` over the ranks (KV block counts must agree)."""
        t = torch.tensor([value], dtype=torch.long, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def take_stats(self) -> CollectiveStats:
        """The stats since the last call (CUDA timings resolved here), and start counting afresh."""
        s = self.stats
        if s._events:
            torch.cuda.synchronize(self.device)
            s.seconds += sum(a.elapsed_time(b) for a, b in s._events) / 1000.0
            s._events = []
        self.stats = CollectiveStats()
        return s


def communicator() -> Optional[Communicator]:
    """The communicator of the shard being built, or None (one rank, or sizing only)."""
    return _COMM


def rank_device(device: str, rank: int) -> torch.device:
    """The device of tensor-parallel rank `rank`: cuda:N+rank from cuda:N, the CPU for every rank on CPU."""
    d = torch.device(device)
    return torch.device("cuda", (d.index or 0) + rank) if d.type == "cuda" else d


def backend_for(device: torch.device) -> str:
    """nccl between CUDA devices, gloo between CPU processes."""
    return "nccl" if device.type == "cuda" else "gloo"


# How long the ranks may take to meet at start-up (spawning and importing torch is slow on a loaded machine).
STARTUP_TIMEOUT_S = 180.0


def init_distributed(rank: int, size: int, init_method: str, device: torch.device, timeout_s: float) -> Communicator:
    """Join the process group and return this rank's communicator. The ranks meet within STARTUP_TIMEOUT_S;
    every later collective fails after `timeout_s` instead of hanging. One group per process."""
    if dist.is_initialized():
        from llmrt.errors import UnsupportedError

        raise UnsupportedError("this process already belongs to a tensor-parallel group; run one split engine "
                               "per process", param="tensor_parallel_size")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = backend_for(device)
    dist.init_process_group(backend, init_method=init_method, world_size=size, rank=rank,
                            timeout=datetime.timedelta(seconds=max(timeout_s, STARTUP_TIMEOUT_S)),
                            **({"device_id": device} if device.type == "cuda" else {}))
    group = dist.new_group(list(range(size)), timeout=datetime.timedelta(seconds=timeout_s), backend=backend)
    comm = Communicator(group, rank, size, device)
    logger.info("rank %d of %d joined the %s group", rank, size, backend_for(device))
    return comm


def shutdown_distributed() -> None:
    """Leave the process group (a no-op when none was joined)."""
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
