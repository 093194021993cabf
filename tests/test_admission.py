"""The --max-waiting-requests bound under every interleaving of clients, engine-core steps and the messages
between them (issue 11's scenario: N = 4, max_num_seqs 4, 40 concurrent clients), checked on the core's real
waiting queue, not on a sampled gauge."""
from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import pytest

from llmrt.engine.admission import AdmissionController
from llmrt.engine.messages import EngineStats, StepResult
from llmrt.errors import CapacityExceededError

MAX_WAITING, MAX_NUM_SEQS, CLIENTS, STEPS_PER_REQUEST = 4, 4, 40, 3


@dataclass
class SimCore:
    """The engine core's loop as core_process runs it: take every message in the inbox, step, report the
    stats after the step with the requests it took in since its previous message."""

    inbox: deque = field(default_factory=deque)
    waiting: deque = field(default_factory=deque)
    running: dict = field(default_factory=dict)  # request id -> steps left
    num_steps: int = 0
    max_waiting_seen: int = 0

    def iterate(self) -> Optional[StepResult]:
        acknowledged = []
        while self.inbox:
            request_id = self.inbox.popleft()
            self.waiting.append(request_id)
            acknowledged.append(request_id)
        self.max_waiting_seen = max(self.max_waiting_seen, len(self.waiting))
        if not self.waiting and not self.running:
            return StepResult([], self.stats(), float(self.num_steps), acknowledged) if acknowledged else None
        while self.waiting and len(self.running) < MAX_NUM_SEQS:
            self.running[self.waiting.popleft()] = STEPS_PER_REQUEST
        for request_id in list(self.running):
            self.running[request_id] -= 1
            if not self.running[request_id]:
                del self.running[request_id]
        self.num_steps += 1
        return StepResult([], self.stats(), float(self.num_steps), acknowledged)

    def stats(self) -> EngineStats:
        return EngineStats(len(self.running), len(self.waiting), 10 * len(self.waiting), 100, 50, self.num_steps,
                           4 * len(self.running), 0)


def _run(seed: int, count_unacknowledged: bool = True) -> tuple[int, int]:
    """One seeded interleaving; (most requests ever waiting in the core, requests admitted)."""
    rng = random.Random(seed)
    ac = AdmissionController(MAX_WAITING, None)
    core, outbox = SimCore(), deque()
    stats: Optional[EngineStats] = None  # what the front end has seen
    pending_clients, admitted, n = CLIENTS, 0, 0
    while pending_clients or core.inbox or core.waiting or core.running or outbox:
        event = rng.random()
        if event < 0.5 and pending_clients:  # a client calls generate(): admit, then send to the core
            pending_clients -= 1
            try:
                ac.admit(stats, 10)
            except CapacityExceededError:
                continue
            request_id = f"r{n}"
            n += 1
            core.inbox.append(request_id)
            if count_unacknowledged:
                ac.submitted(request_id, 10)
            admitted += 1
        elif event < 0.75:  # the core finishes an iteration
            msg = core.iterate()
            if msg is not None:
                outbox.append(msg)
        elif outbox:  # the front end's reader delivers one message
            msg = outbox.popleft()
            stats = msg.stats
            ac.acknowledged(msg.acknowledged)
            ac.observe_step(msg.stats, msg.core_time)
    return core.max_waiting_seen, admitted


@pytest.mark.parametrize("seed", range(200))
def test_the_waiting_bound_is_exact_under_every_interleaving(seed):
    most_waiting, admitted = _run(seed)
    assert most_waiting <= MAX_WAITING
    assert admitted >= MAX_WAITING  # the bound refuses only what it must


def test_counting_only_what_a_step_reported_breaks_the_bound():
    """The bug of issue 11 (the pending count reset by every step message) in the same simulation: the check
    above can fail."""
    assert max(_run(seed, count_unacknowledged=False)[0] for seed in range(200)) > MAX_WAITING
