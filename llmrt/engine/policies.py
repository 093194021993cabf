"""Waiting-queue order and preemption victims; the scheduler asks, the policy answers."""
from __future__ import annotations

from collections import deque
from typing import Iterator, Protocol

from llmrt.engine.request import Sequence
from llmrt.errors import UnsupportedError


class SchedulingPolicy(Protocol):
    """Orders waiting sequences and picks whom to preempt."""

    def add(self, seq: Sequence) -> None:
        """Queue a newly arrived sequence."""

    def add_preempted(self, seq: Sequence) -> None:
        """Queue a sequence whose KV was just freed, to be recomputed."""

    def peek(self) -> Sequence:
        """The sequence to admit next."""

    def pop(self) -> Sequence:
        """Remove and return the sequence `peek` names."""

    def remove(self, seq: Sequence) -> None:
        """Drop a waiting sequence (abort)."""

    def choose_victim(self, running: list[Sequence]) -> Sequence:
        """The running sequence to preempt when blocks run out."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Sequence]: ...


class FCFSPolicy:
    """First come, first served; preempted sequences go back to the front; the newest is preempted first."""

    def __init__(self) -> None:
        self._queue: deque[Sequence] = deque()

    def add(self, seq: Sequence) -> None:
        self._queue.append(seq)

    def add_preempted(self, seq: Sequence) -> None:
        self._queue.appendleft(seq)

    def peek(self) -> Sequence:
        return self._queue[0]

    def pop(self) -> Sequence:
        return self._queue.popleft()

    def remove(self, seq: Sequence) -> None:
        self._queue.remove(seq)

    def choose_victim(self, running: list[Sequence]) -> Sequence:
        return running[-1]

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._queue)


POLICIES = {"fcfs": FCFSPolicy}


def make_policy(name: str) -> SchedulingPolicy:
    """Build the policy called `name`."""
    if name not in POLICIES:
        raise UnsupportedError(f"scheduling policy {name!r} is not supported; supported: {', '.join(POLICIES)}",
                               param="scheduling_policy")
    return POLICIES[name]()
