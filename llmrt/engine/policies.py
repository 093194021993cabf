"""Scheduling policies: who runs first and whom to preempt. The scheduler asks, the policy answers.

A policy ranks sequences (a lower rank runs first); the scheduler serves running decodes first, then prefill
work (running prefill chunks and waiting sequences together) in rank order, and preempts the highest rank.
"""
from __future__ import annotations

from typing import Iterator

from llmrt.config import SCHEDULING_POLICIES, SchedulerConfig
from llmrt.engine.request import Request, Sequence

Rank = tuple[int, ...]


class SchedulingPolicy:
    """First come, first served: rank by arrival; the newest is preempted first."""

    name = "fcfs"
    preempts_for_waiting = False  # may preempt running sequences to admit a waiting one that outranks them
    ranks_move_within_a_step = False  # whether `scheduled` changes ranks (then the next pick is re-ranked)

    def rank(self, seq: Sequence, step: int) -> Rank:
        """Lower runs first; `step` is the scheduler's step counter (for aging)."""
        return (seq.request.arrival_order, seq.index)

    def outranks(self, seq: Sequence, other: Sequence) -> bool:
        """Whether waiting `seq` may take running `other`'s place (only where preempts_for_waiting)."""
        return False

    def victim(self, candidates: list[Sequence], step: int) -> Sequence:
        """The sequence to preempt among `candidates`: the one ranked last."""
        return max(candidates, key=lambda s: self.rank(s, step))

    def request_added(self, request: Request) -> None:
        """A request arrived."""

    def request_finished(self, request: Request) -> None:
        """A request finished (or was aborted)."""

    def scheduled(self, seq: Sequence, num_tokens: int) -> None:
        """`seq` computes `num_tokens` tokens this step."""


class FCFSPolicy(SchedulingPolicy):
    """First come, first served (preempted sequences keep their place: they arrived earlier)."""


class PriorityPolicy(SchedulingPolicy):
    """The request's `priority` (lower first), ties first come first served; may preempt lower priorities."""

    name = "priority"
    preempts_for_waiting = True

    def rank(self, seq: Sequence, step: int) -> Rank:
        return (seq.request.priority, seq.request.arrival_order, seq.index)

    def outranks(self, seq: Sequence, other: Sequence) -> bool:
        return seq.request.priority < other.request.priority


class ShortFirstPolicy(SchedulingPolicy):
    """Fewest remaining prefill tokens first, with aging: a request's rank falls linearly with its wait and
    reaches zero after `aging_steps` steps, so after that no later arrival passes it."""

    name = "short-first"

    def __init__(self, aging_steps: int):
        self.aging_steps = aging_steps

    def rank(self, seq: Sequence, step: int) -> Rank:
        remaining = seq.num_tokens - seq.num_computed_tokens
        waited = max(0, step - seq.queued_at_step)
        return (remaining * max(0, self.aging_steps - waited), seq.request.arrival_order, seq.index)


class FairPolicy(SchedulingPolicy):
    """Token fairness across the OpenAI `user` field: the user served the fewest tokens goes first.

    A user who becomes active starts from the least-served active user's count, not from zero, so a newcomer
    shares from then on instead of taking everything until it has caught up with users served for hours.
    """

    name = "fair"
    ranks_move_within_a_step = True

    def __init__(self) -> None:
        self.served: dict[str, int] = {}
        self.active: dict[str, int] = {}  # user -> unfinished requests

    def rank(self, seq: Sequence, step: int) -> Rank:
        return (self.served.get(_user(seq.request), 0), seq.request.arrival_order, seq.index)

    def request_added(self, request: Request) -> None:
        user = _user(request)
        if not self.active.get(user):
            floor = min((self.served.get(u, 0) for u, n in self.active.items() if n), default=0)
            self.served[user] = max(self.served.get(user, 0), floor)
        self.active[user] = self.active.get(user, 0) + 1

    def request_finished(self, request: Request) -> None:
        user = _user(request)
        self.active[user] = max(0, self.active.get(user, 0) - 1)

    def scheduled(self, seq: Sequence, num_tokens: int) -> None:
        user = _user(seq.request)
        self.served[user] = self.served.get(user, 0) + num_tokens


def _user(request: Request) -> str:
    return request.user or ""


def make_policy(config: SchedulerConfig) -> SchedulingPolicy:
    """Build the policy the config names (validated there)."""
    builders = {"fcfs": FCFSPolicy, "priority": PriorityPolicy, "fair": FairPolicy,
                "short-first": lambda: ShortFirstPolicy(config.short_first_aging_steps)}
    assert set(builders) == set(SCHEDULING_POLICIES)
    return builders[config.policy]()


class WaitingQueue:
    """The sequences waiting to run (new or preempted), in arrival order; the policy orders them each step."""

    def __init__(self) -> None:
        self._items: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        """Queue a sequence."""
        self._items.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a waiting sequence (admitted or aborted)."""
        self._items.remove(seq)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._items)
