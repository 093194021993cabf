"""Pipeline parallelism: which layers a rank's stage holds, and the point-to-point traffic between stages.

Ranks are laid out stage-major: global rank = stage x tp + tp_rank, so rank 0 (the engine core) is the first
stage's first tensor-parallel rank. Each stage's tp ranks form their own tensor-parallel group; activations go
from a rank to the rank of the same tp index in the next stage, and the last stage's tp rank 0 sends the
gathered logits back to rank 0, which samples.
"""
from __future__ import annotations

import contextlib
import datetime
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from llmrt.distributed.parallel_state import Communicator, STARTUP_TIMEOUT_S, init_distributed

# Message tags: stage-to-stage activations and logits back to rank 0 travel on separate channels.
TAG_CARRY, TAG_LOGITS, TAG_TIMES = 1, 2, 3


@dataclass(frozen=True)
class PPStage:
    """Stage `index` of `size`: a contiguous, equal share of the decoder layers."""

    index: int = 0
    size: int = 1

    @property
    def is_first(self) -> bool:
        """Holds the embedding."""
        return self.index == 0

    @property
    def is_last(self) -> bool:
        """Holds the final norm and the LM head."""
        return self.index == self.size - 1

    def layer_range(self, num_layers: int) -> range:
        """The layer indices this stage runs (sizes are checked to divide at start-up)."""
        per = num_layers // self.size
        return range(self.index * per, (self.index + 1) * per)


_STAGE = PPStage()


def pp_stage() -> PPStage:
    """The stage models built now belong to (stage 0 of 1 outside pipeline parallelism)."""
    return _STAGE


@contextlib.contextmanager
def building_stage(index: int, size: int) -> Iterator[None]:
    """Build models as pipeline stage `index` of `size` (also used by `llmrt plan` on the meta device)."""
    global _STAGE
    old, _STAGE = _STAGE, PPStage(index, size)
    try:
        yield
    finally:
        _STAGE = old


@dataclass
class StageTimes:
    """One stage's step: seconds blocked waiting for another stage, and seconds in all (the rest computes)."""

    wait: float = 0.0
    total: float = 0.0
    p2p_bytes: int = 0


@dataclass
class PipeComm:
    """A rank's pipeline links: the group its point-to-point messages use and its neighbours' global ranks."""

    rank: int
    stage: PPStage
    tp: int
    device: torch.device
    step_group: Optional[dist.ProcessGroup]
    # Logits and stage timings go back to rank 0 on their own groups: on NCCL each group has its own stream, so a
    # backward message queued behind the next micro-batch's activations on a shared stream cannot deadlock.
    back_step_group: Optional[dist.ProcessGroup] = None
    back_start_group: Optional[dist.ProcessGroup] = None
    group: Optional[dist.ProcessGroup] = None  # start-up: the default group's long timeout
    back_group: Optional[dist.ProcessGroup] = None
    times: StageTimes = field(default_factory=StageTimes)
    _sends: list = field(default_factory=list, repr=False)

    @property
    def tp_rank(self) -> int:
        """This rank's index inside its stage's tensor-parallel group."""
        return self.rank % self.tp

    def stage_rank(self, stage: int, tp_rank: Optional[int] = None) -> int:
        """The global rank of `stage`'s tp rank `tp_rank` (default: this rank's)."""
        return stage * self.tp + (self.tp_rank if tp_rank is None else tp_rank)

    def __post_init__(self) -> None:
        self.back_group = self.back_start_group

    def use_step_timeout(self) -> None:
        """From now on a message not answered within the step timeout fails."""
        self.group, self.back_group = self.step_group, self.back_step_group

    def _group_for(self, tag: int) -> Optional[dist.ProcessGroup]:
        return self.group if tag == TAG_CARRY else self.back_group

    @contextlib.contextmanager
    def _waiting(self) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        self.times.wait += time.perf_counter() - t0

    def send(self, t: torch.Tensor, dst: int, tag: int) -> None:
        """Start sending `t` to global rank `dst` (completes by `finish_sends`)."""
        t = t.contiguous()
        self.times.p2p_bytes += t.numel() * t.element_size()
        self._sends.append((dist.isend(t, dst=dst, group=self._group_for(tag), tag=tag), t))

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, tag: int) -> torch.Tensor:
        """Receive a tensor of `shape` from global rank `src` (time blocked counts as waiting)."""
        t = torch.empty(shape, dtype=dtype, device=self.device)
        with self._waiting():
            dist.recv(t, src=src, group=self._group_for(tag), tag=tag)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
        return t

    def finish_sends(self) -> None:
        """Wait for this step's sends to be taken (their buffers may then be reused)."""
        with self._waiting():
            for work, _ in self._sends:
                work.wait()
        self._sends = []

    def all_min(self, value: int) -> int:
        """The smallest `value` over every rank of every stage (KV block counts must agree)."""
        t = torch.tensor([value], dtype=torch.long, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def take_times(self) -> StageTimes:
        """This rank's figures since the last call."""
        t, self.times = self.times, StageTimes()
        return t


def join_groups(rank: int, tp: int, pp: int, init_method: str, device: torch.device,
                timeout_s: float) -> tuple[Optional[Communicator], Optional[PipeComm]]:
    """Join the process group as global `rank` of tp x pp; this rank's tensor-parallel communicator (None at
    tp = 1) and pipeline links (None at pp = 1). Every rank creates every stage's group, in the same order."""
    world_comm = init_distributed(rank, tp * pp, init_method, device, timeout_s)
    if pp == 1:
        return world_comm, None
    stage = rank // tp
    tp_comm: Optional[Communicator] = None
    backend = dist.get_backend()
    for s in range(pp):
        ranks = list(range(s * tp, (s + 1) * tp))
        if tp == 1:
            continue
        start = dist.new_group(ranks, timeout=datetime.timedelta(seconds=max(timeout_s, STARTUP_TIMEOUT_S)),
                               backend=backend)
        step = dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout_s), backend=backend)
        if s == stage:
            tp_comm = Communicator(step, rank % tp, tp, device)
            tp_comm.group = start
    world = list(range(tp * pp))
    back_start = dist.new_group(world, timeout=datetime.timedelta(seconds=max(timeout_s, STARTUP_TIMEOUT_S)),
                                backend=backend)
    back_step = dist.new_group(world, timeout=datetime.timedelta(seconds=timeout_s), backend=backend)
    pipe = PipeComm(rank, PPStage(stage, pp), tp, device, world_comm.step_group, back_step, back_start)
    return tp_comm, pipe


@dataclass
class PipelineTotals:
    """Every stage's waiting and total seconds summed over steps (the engine core keeps one)."""

    wait: list[float]
    total: list[float]
    steps: int = 0

    @classmethod
    def of(cls, stages: int) -> "PipelineTotals":
        """Zeros for `stages` stages."""
        return cls([0.0] * stages, [0.0] * stages)

    def observe(self, stage_times: list[StageTimes]) -> None:
        """Add one step (stages that did not report are skipped)."""
        if not stage_times:
            return
        for i, t in enumerate(stage_times[:len(self.wait)]):
            self.wait[i] += t.wait
            self.total[i] += t.total
        self.steps += 1

    @property
    def bubble_share(self) -> float:
        """Waiting over total time, all stages together."""
        total = sum(self.total)
        return sum(self.wait) / total if total else 0.0
