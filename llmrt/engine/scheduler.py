"""Continuous batching: each step, running sequences continue and waiting ones join, under a token budget."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Optional

from llmrt.config import SchedulerConfig
from llmrt.engine.kv_cache import BlockManager
from llmrt.engine.policies import make_policy
from llmrt.engine.request import Request, Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    """A sequence's share of one step: how many new tokens, and how many samples to draw after them."""

    seq: Sequence
    num_new_tokens: int
    num_samples: int  # 0 for a prefill chunk that does not reach the end of the known tokens


@dataclass
class SchedulerOutput:
    """What the model runner executes this step."""

    scheduled: list[ScheduledSequence]
    block_copies: list[tuple[int, int]]
    num_batched_tokens: int
    num_preempted: int = 0

    @property
    def is_empty(self) -> bool:
        """True when nothing runs this step."""
        return not self.scheduled


@dataclass
class ModelRunnerOutput:
    """Sampled tokens (and their logprobs) for each ScheduledSequence with num_samples > 0, in order."""

    sampled_token_ids: list[list[int]]
    logprobs: Optional[list[list[dict[int, float]]]] = None
    prompt_logprobs: dict[int, list[dict[int, float]]] = field(default_factory=dict)  # seq_id -> rows of a span


@dataclass
class EngineCoreOutput:
    """What one step produced for one sample: its new tokens and, if it ended, why."""

    request_id: str
    index: int
    new_token_ids: list[int]
    new_logprobs: Optional[list[dict[int, float]]] = None
    finish_reason: Optional[str] = None  # stop | length | abort | deadline | error
    stop_reason: Optional[object] = None  # the stop token id; for 'error', the error code
    first_scheduled_time: Optional[float] = None
    num_preemptions: int = 0
    timestamp: float = field(default_factory=time.monotonic)
    prompt_logprobs: Optional[list[Optional[dict[int, float]]]] = None  # with a request's first token


class Scheduler:
    """Decides each step which sequences run and how many tokens each computes."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int):
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.waiting = make_policy(config.policy)
        self.running: list[Sequence] = []
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self.num_preemptions_total = 0

    # -- admission -------------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a validated request as its first sample."""
        seq = Sequence(next(self._seq_ids), request, 0, list(request.prompt_token_ids))
        request.sequences.append(seq)
        self.requests[request.request_id] = request
        self.waiting.add(seq)

    def abort_request(self, request_id: str) -> list[EngineCoreOutput]:
        """Finish every unfinished sample of a request with reason 'abort' and free its blocks."""
        request = self.requests.get(request_id)
        if request is None:
            return []
        outs = [self._finish(s, "abort") for s in request.sequences if not s.is_finished]
        self.requests.pop(request_id, None)
        return outs

    def finish_sequence(self, request_id: str, index: int, reason: str = "stop") -> None:
        """End one sample early (the front end saw a stop string); frees its blocks."""
        request = self.requests.get(request_id)
        if request is None:
            return
        for s in request.sequences:
            if s.index == index and not s.is_finished:
                self._finish(s, reason)
        if request.is_finished():
            self.requests.pop(request_id, None)

    def drop_expired(self, now: float) -> list[EngineCoreOutput]:
        """Finish every request whose deadline has passed with reason 'deadline' (queued ones cost no compute)."""
        outs: list[EngineCoreOutput] = []
        for request_id in [r for r, req in self.requests.items() if req.deadline is not None and req.deadline <= now]:
            req = self.requests.pop(request_id)
            outs += [self._finish(s, "deadline") for s in req.sequences if not s.is_finished]
        return outs

    def shrink_after_oom(self, failed: SchedulerOutput) -> list[EngineCoreOutput]:
        """A step ran out of memory: preempt the newest half of the batch, or fail a sequence that ran alone."""
        if len(self.running) > 1:
            for _ in range(len(self.running) // 2):
                self._preempt(self.waiting.choose_victim(self.running))
            return []
        outs = []
        for seq in list(self.running):
            outs.append(self._finish(seq, "error", "out_of_memory"))
            self.requests.pop(seq.request.request_id, None)
        return outs

    def has_unfinished(self) -> bool:
        """True while any sequence waits or runs."""
        return bool(self.running) or len(self.waiting) > 0

    @property
    def num_waiting(self) -> int:
        """Sequences waiting (new or preempted)."""
        return len(self.waiting)

    # -- one step --------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's work: running sequences first, then waiting ones while budget and blocks last."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        copies: list[tuple[int, int]] = []
        preempted = 0
        bm = self.block_manager

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not bm.can_allocate(seq, n):
                victim = self.waiting.choose_victim(self.running[i:])
                self._preempt(victim)
                preempted += 1
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # seq itself was preempted; running[i] is now the next one
            copies += bm.allocate(seq, n)
            scheduled.append(ScheduledSequence(seq, n, self._samples_after(seq, n)))
            budget -= n
            i += 1

        # Admit waiting sequences only when nobody had to be preempted this step.
        while not preempted and budget > 0 and len(self.waiting) > 0:
            seq = self.waiting.peek()
            extra = seq.request.params.n if seq.index == 0 and not seq.request.forked else 1
            if len(self.running) + extra > self.config.max_num_seqs:
                break
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not bm.can_allocate(seq, n):
                break
            self.waiting.pop()
            copies += bm.allocate(seq, n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if seq.request.first_scheduled_time is None:
                seq.request.first_scheduled_time = time.monotonic()
            scheduled.append(ScheduledSequence(seq, n, self._samples_after(seq, n)))
            budget -= n

        used = self.config.max_num_batched_tokens - budget
        return SchedulerOutput(scheduled, copies, used, preempted)

    def update(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Advance sequences by what the step computed and sampled; finish those that hit a stop."""
        outputs: list[EngineCoreOutput] = []
        k = 0
        now = time.monotonic()
        for item in out.scheduled:
            seq = item.seq
            rows = result.prompt_logprobs.get(seq.seq_id)
            if rows:
                have = seq.request.prompt_logprobs
                have.extend(rows[len(have) - 1 - seq.num_computed_tokens:])  # a recompute repeats rows
            seq.num_computed_tokens += item.num_new_tokens
            if not item.num_samples:
                continue
            tokens = result.sampled_token_ids[k]
            logprobs = result.logprobs[k] if result.logprobs else None
            k += 1
            if seq.is_finished:  # aborted while the step ran
                continue
            targets = [seq]
            if item.num_samples > 1:
                targets += self._fork(seq, item.num_samples)
            for j, (target, token) in enumerate(zip(targets, tokens)):
                target.token_ids.append(token)
                reason, stop = self._check_stop(target, token)
                req = target.request
                outputs.append(EngineCoreOutput(
                    req.request_id, target.index, [token], [logprobs[j]] if logprobs else None, reason, stop,
                    req.first_scheduled_time, req.num_preemptions, now,
                    req.prompt_logprobs if target.index == 0 and target.num_output_tokens == 1 else None,
                ))
                if reason is not None:
                    self._finish(target, reason, stop)
        for req_id in {o.request_id for o in outputs if o.finish_reason}:
            req = self.requests.get(req_id)
            if req is not None and req.is_finished():
                del self.requests[req_id]
        return outputs

    # -- helpers ---------------------------------------------------------------------------------------
    def _samples_after(self, seq: Sequence, n: int) -> int:
        if seq.num_computed_tokens + n < seq.num_tokens:
            return 0
        req = seq.request
        return req.params.n if seq.index == 0 and not req.forked else 1

    def _fork(self, parent: Sequence, n: int) -> list[Sequence]:
        req = parent.request
        req.forked = True
        children = []
        for index in range(1, n):
            child = Sequence(next(self._seq_ids), req, index, list(parent.token_ids),
                             SequenceStatus.RUNNING, parent.num_computed_tokens)
            self.block_manager.fork(parent, child)
            req.sequences.append(child)
            self.running.append(child)
            children.append(child)
        return children

    def _check_stop(self, seq: Sequence, token: int) -> tuple[Optional[str], Optional[int]]:
        p = seq.params
        done_min = seq.num_output_tokens >= p.min_tokens
        if done_min and not p.ignore_eos and token in p.eos_token_ids:
            return "stop", None
        if done_min and token in p.stop_token_ids:
            return "stop", token
        if seq.num_output_tokens >= seq.request.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length", None
        return None, None

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        seq.request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.add_preempted(seq)

    def _finish(self, seq: Sequence, reason: str, stop: Optional[object] = None) -> EngineCoreOutput:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED):
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop
        req = seq.request
        return EngineCoreOutput(req.request_id, seq.index, [], None, reason, stop, req.first_scheduled_time,
                                req.num_preemptions)
