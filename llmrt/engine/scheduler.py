"""Continuous batching: each step, running sequences continue and waiting ones join, under a token budget."""
from __future__ import annotations

import itertools
import logging
import time
from typing import Optional

from llmrt.config import SchedulerConfig, SpeculativeConfig
from llmrt.engine.kv_cache import BlockManager, HostBlockPool
from llmrt.engine.messages import EngineCoreOutput, FinishReason, StopReason
from llmrt.engine.policies import WaitingQueue, make_policy
from llmrt.engine.request import Request, Sequence, SequenceStatus
from llmrt.engine.speculation import SpeculationPlanner
from llmrt.engine.step import ModelRunnerOutput, ScheduledSequence, SchedulerOutput

logger = logging.getLogger(__name__)


class Scheduler:
    """Decides each step which sequences run and how many tokens each computes."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int,
                 host_pool: Optional[HostBlockPool] = None, speculative: Optional[SpeculativeConfig] = None):
        self.config = config
        self.spec = SpeculationPlanner(speculative, block_manager, max_model_len) \
            if speculative is not None and speculative.enabled else None
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.policy = make_policy(config)
        self.waiting = WaitingQueue()
        self.running: list[Sequence] = []
        self.requests: dict[str, Request] = {}
        self.host_pool = host_pool if config.preemption_mode == "swap" else None
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self.step = 0
        self.num_preemptions_total = 0
        self.num_swaps_out = 0
        self._swap_out: list[tuple[int, int]] = []  # preemptions since the last schedule() (e.g. after an OOM)
        self._host_to_release: list[int] = []  # host blocks whose swap-in runs in the step being built
        self.watermark_blocks = int(config.kv_watermark * block_manager.num_blocks)

    # -- admission -------------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a validated request as its first sample."""
        seq = Sequence(next(self._seq_ids), request, 0, list(request.prompt_token_ids), queued_at_step=self.step,
                       grammar=request.grammar)
        request.arrival_order = next(self._arrivals)
        request.sequences.append(seq)
        self.requests[request.request_id] = request
        self.policy.request_added(request)
        self.waiting.add(seq)

    def abort_request(self, request_id: str) -> list[EngineCoreOutput]:
        """Finish every unfinished sample of a request with reason 'abort' and free its blocks."""
        request = self.requests.get(request_id)
        if request is None:
            return []
        outs = [self._finish(s, FinishReason.ABORT) for s in request.sequences if not s.is_finished]
        self._forget(request_id)
        return outs

    def finish_sequence(self, request_id: str, index: int, reason: FinishReason = FinishReason.STOP) -> None:
        """End one sample early (the front end saw a stop string); frees its blocks."""
        request = self.requests.get(request_id)
        if request is None:
            return
        for s in request.sequences:
            if s.index == index and not s.is_finished:
                self._finish(s, reason)
        if request.is_finished():
            self._forget(request_id)

    def drop_expired(self, now: float) -> list[EngineCoreOutput]:
        """Finish every request whose deadline has passed with reason 'deadline' (queued ones cost no compute)."""
        outs: list[EngineCoreOutput] = []
        for request_id in [r for r, req in self.requests.items() if req.deadline is not None and req.deadline <= now]:
            req = self.requests[request_id]
            outs += [self._finish(s, FinishReason.DEADLINE) for s in req.sequences if not s.is_finished]
            self._forget(request_id)
        return outs

    def shrink_after_oom(self, failed: SchedulerOutput) -> list[EngineCoreOutput]:
        """A step ran out of memory: preempt the policy's last half of the batch, or fail a sequence alone."""
        if len(self.running) > 1:
            for _ in range(len(self.running) // 2):
                self._preempt(self.policy.victim(self.running, self.step))
            return []
        outs = []
        for seq in list(self.running):
            outs.append(self._finish(seq, FinishReason.ERROR, "out_of_memory"))
            self._forget(seq.request.request_id)
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
        """Pick this step's work: running decodes first, then prefill work (running chunks and waiting
        sequences) in the policy's order, while the token budget, the batch slots and the blocks last."""
        self.step += 1
        self._release_host_blocks()
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        copies: list[tuple[int, int]] = []
        swap_in: list[tuple[int, int]] = []
        done: set[int] = set()  # seq_ids scheduled this step: never preempted after that
        just_preempted = self._preempt_for_waiting() if self.policy.preempts_for_waiting else set()
        preempted = 0  # preemptions to let running sequences grow; they stop admissions this step
        rank = lambda s: self.policy.rank(s, self.step)  # noqa: E731
        decodes = sorted((s for s in self.running if s.num_tokens - s.num_computed_tokens == 1), key=rank)
        prefills = [s for s in self.running if s.num_tokens - s.num_computed_tokens > 1]
        prefills += [s for s in self.waiting if s not in just_preempted]
        free_slots = self.config.max_num_seqs - len(self.running)
        spec_share = self.spec.share(decodes, prefills, free_slots, budget) if self.spec else 0
        admitting = True
        repick = self.policy.ranks_move_within_a_step
        if not repick:  # ranked once, popped from the end: a long queue costs one sort, not a scan per admission
            prefills.sort(key=rank, reverse=True)
        while budget > 0 and (decodes or prefills):
            # Where ranks change as work is scheduled (fair shares), the next prefill is picked each time.
            seq = decodes.pop(0) if decodes else (
                prefills.pop(min(range(len(prefills)), key=lambda i: rank(prefills[i]))) if repick else prefills.pop())
            drafts: list[int] = []
            if seq.status is SequenceStatus.RUNNING:
                n = min(seq.num_tokens - seq.num_computed_tokens, budget)
                if n == 1 and spec_share:
                    drafts = self.spec.drafts(seq, min(spec_share, budget - 1), self.step)
                    n += len(drafts)
                made_room, count = self._make_room(seq, n, done)
                preempted += count
                if count:
                    prefills = self._running_only(prefills)
                if not made_room:
                    continue
                copies += self.block_manager.allocate(seq, n + (self.spec.lookahead(seq, n) if self.spec else 0))
            elif admitting and not preempted:
                admitted = self._admit(seq, budget, swap_in)
                if admitted is None:
                    admitting = False  # no one passes a sequence that does not fit: it would starve
                    prefills = self._running_only(prefills)
                    continue
                n, new_copies = admitted
                copies += new_copies
            else:
                continue
            done.add(seq.seq_id)
            scheduled.append(ScheduledSequence(seq, n, self._samples_after(seq, n - len(drafts)), drafts))
            self.policy.scheduled(seq, n)
            budget -= n
        used = self.config.max_num_batched_tokens - budget
        swap_out, self._swap_out = self._swap_out, []
        propose = self.spec is not None and self.spec.worth_proposing(len(self.running),
                                                                      self.config.max_num_batched_tokens)
        return SchedulerOutput(scheduled, copies, used, preempted + len(just_preempted), swap_out, swap_in, propose)

    @staticmethod
    def _running_only(prefills: list[Sequence]) -> list[Sequence]:
        # Once admissions stop for this step, waiting sequences would only be popped and skipped: with a long
        # queue that made every step quadratic in the queue length.
        return [s for s in prefills if s.status is SequenceStatus.RUNNING]

    def _release_host_blocks(self) -> None:
        """Return host blocks whose swap-in (or whose sequence's end) the previous step saw."""
        if self.host_pool is not None and self._host_to_release:
            self.host_pool.release(self._host_to_release)
            self._host_to_release = []

    def update(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Advance sequences by what the step computed and sampled (rolling back rejected proposals); finish
        those that hit a stop, also inside an accepted run of proposals."""
        outputs: list[EngineCoreOutput] = []
        k = 0
        now = time.monotonic()
        for item in out.scheduled:
            seq = item.seq
            rows = result.prompt_logprobs.get(seq.seq_id)
            if rows:
                have = seq.request.prompt_logprobs
                have.extend(rows[len(have) - 1 - seq.num_computed_tokens:])  # a recompute repeats rows
            if not item.num_samples:
                seq.num_computed_tokens += item.num_new_tokens
                if not seq.is_finished:
                    self.block_manager.cache_full_blocks(seq)
                continue
            tokens = result.sampled_token_ids[k]
            logprobs = result.logprobs[k] if result.logprobs else None
            k += 1
            if item.spec_token_ids:
                # Only the accepted proposals' KV counts: the slots of rejected ones are written over later.
                accepted = len(tokens) - 1
                seq.num_computed_tokens += 1 + accepted
                SpeculationPlanner.count_acceptance(seq, len(item.spec_token_ids), accepted)
            else:
                seq.num_computed_tokens += item.num_new_tokens
            if seq.is_finished:  # aborted while the step ran
                continue
            if item.spec_token_ids:
                runs = [(seq, tokens, logprobs)]
            else:
                targets = [seq] + (self._fork(seq, item.num_samples) if item.num_samples > 1 else [])
                runs = [(t, [tok], [logprobs[j]] if logprobs else None) for j, (t, tok) in enumerate(zip(targets, tokens))]
            for target, run, run_logprobs in runs:
                outputs.append(self._append_run(target, run, run_logprobs, now))
            if not seq.is_finished:
                seq.spec_token_ids = result.draft_token_ids.get(seq.seq_id, [])
                seq.spec_step = self.step
                self.block_manager.cache_full_blocks(seq)
        for req_id in {o.request_id for o in outputs if o.finish_reason}:
            req = self.requests.get(req_id)
            if req is not None and req.is_finished():
                self._forget(req_id)
        return outputs

    def _append_run(self, target: Sequence, run: list[int], logprobs: Optional[list[dict[int, float]]],
                    now: float) -> EngineCoreOutput:
        """Append a sample's new tokens one by one, stopping at the first that ends it."""
        reason: Optional[FinishReason] = None
        stop: StopReason = None
        emitted: list[int] = []
        for token in run:
            target.token_ids.append(token)
            emitted.append(token)
            reason, stop = self._check_stop(target, token)
            if target.grammar is not None and not target.grammar.accept(token):
                # Cannot happen while the sampler applies the bitmask; never emit what breaks the grammar.
                logger.error("request %s: token %d is outside its grammar", target.request.request_id, token)
                reason, stop = FinishReason.ABORT, None
            if reason is not None:
                break
        req = target.request
        first = target.index == 0 and target.num_output_tokens == len(emitted)
        output = EngineCoreOutput(
            req.request_id, target.index, emitted, logprobs[:len(emitted)] if logprobs else None, reason, stop,
            req.first_scheduled_time, req.num_preemptions, now,
            req.prompt_logprobs if first else None, req.num_cached_tokens if first else 0,
            spec_proposed=req.spec_proposed, spec_accepted=req.spec_accepted,
        )
        if reason is not None:
            self._finish(target, reason, stop)
        return output

    # -- helpers ---------------------------------------------------------------------------------------
    def _make_room(self, seq: Sequence, n: int, done: set[int]) -> tuple[bool, int]:
        """Preempt the policy's victims (never one already scheduled this step) until `seq`'s next `n` tokens
        fit; (False, count) when `seq` itself was the victim."""
        count = 0
        while not self.block_manager.can_allocate(seq, n):
            victim = self.policy.victim([s for s in self.running if s.seq_id not in done], self.step)
            self._preempt(victim)
            count += 1
            if victim is seq:
                return False, count
        return True, count

    def _admit(self, seq: Sequence, budget: int,
               swap_in: list[tuple[int, int]]) -> Optional[tuple[int, list[tuple[int, int]]]]:
        """Move a waiting sequence into the batch with its first `n` tokens, reusing its cached prefix or its
        swapped-out KV; None (and nothing changed) if the batch slots or the blocks (above the watermark)
        do not allow it."""
        bm, req = self.block_manager, seq.request
        extra = req.params.n if seq.index == 0 and not req.forked else 1
        if len(self.running) + extra > self.config.max_num_seqs:
            return None
        reserve = self.watermark_blocks if self.running else 0  # alone, a sequence may use every block
        copies: list[tuple[int, int]] = []
        if seq.is_swapped:
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            # After a failed (out-of-memory) step it may hold blocks for tokens it never computed.
            need = max(len(seq.host_block_ids), bm.blocks_for(seq.num_computed_tokens + n))
            if need + reserve > bm.num_free_blocks:
                return None
            seq.block_ids = bm.take_fresh(len(seq.host_block_ids))
            swap_in += list(zip(seq.host_block_ids, seq.block_ids))
            self._host_to_release += seq.host_block_ids
            seq.host_block_ids = []
        else:
            cached = [] if req.params.prompt_logprobs is not None else bm.match_prefix(seq)
            computed = len(cached) * bm.block_size
            n = min(seq.num_tokens - computed, budget)
            fresh = bm.blocks_for(computed + n) - len(cached)
            if fresh + bm.num_free_taken_by(cached) + reserve > bm.num_free_blocks:
                return None
            if cached:
                bm.take_prefix(seq, cached)
            if req.first_scheduled_time is None and seq.index == 0:
                req.num_cached_tokens = computed
                bm.record_lookup(req.num_prompt_tokens, computed)
        copies += bm.allocate(seq, n)
        self.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
        return n, copies

    def _preempt_for_waiting(self) -> set[Sequence]:
        """Preempt running sequences the best waiting one outranks until it fits (priority scheduling)."""
        victims: set[Sequence] = set()
        if not len(self.waiting) or not self.running:
            return victims
        best = min(self.waiting, key=lambda s: self.policy.rank(s, self.step))
        bm = self.block_manager
        while self.running:
            extra = best.request.params.n if best.index == 0 and not best.request.forked else 1
            n = min(best.num_tokens - best.num_computed_tokens, self.config.max_num_batched_tokens)
            need = bm.blocks_for(best.num_computed_tokens + n) + (self.watermark_blocks if self.running else 0)
            if len(self.running) + extra <= self.config.max_num_seqs and need <= bm.num_free_blocks:
                break
            worst = self.policy.victim(self.running, self.step)
            if not self.policy.outranks(best, worst):
                break
            self._preempt(worst)
            victims.add(worst)
        return victims

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
                             SequenceStatus.RUNNING, parent.num_computed_tokens, queued_at_step=parent.queued_at_step,
                             grammar=parent.grammar.fork() if parent.grammar is not None else None)
            self.block_manager.fork(parent, child)
            req.sequences.append(child)
            self.running.append(child)
            children.append(child)
        return children

    def _check_stop(self, seq: Sequence, token: int) -> tuple[Optional[FinishReason], Optional[int]]:
        p = seq.params
        done_min = seq.num_output_tokens >= p.min_tokens
        if done_min and not p.ignore_eos and token in p.eos_token_ids:
            return FinishReason.STOP, None
        if done_min and token in p.stop_token_ids:
            return FinishReason.STOP, token
        if seq.num_output_tokens >= seq.request.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH, None
        return None, None

    def _preempt(self, seq: Sequence) -> None:
        """Take `seq` out of the batch: swap its KV to host memory (swap mode, when the pool has room) or
        drop it to be recomputed; either way its device blocks are free when this returns."""
        self.running.remove(seq)
        pool = self.host_pool
        if pool is not None and seq.block_ids and pool.num_free_blocks >= len(seq.block_ids):
            seq.host_block_ids = pool.take(len(seq.block_ids))
            self._swap_out += list(zip(seq.block_ids, seq.host_block_ids))
            self.num_swaps_out += 1
            self.block_manager.free(seq)  # num_computed_tokens stays: the KV comes back on swap-in
        else:
            self.block_manager.free(seq)
            seq.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        seq.request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.add(seq)

    def _finish(self, seq: Sequence, reason: FinishReason, stop: StopReason = None) -> EngineCoreOutput:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED):
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        if seq.host_block_ids and self.host_pool is not None:
            # A swap-out still queued for it is moot; the blocks return to the pool when the next step starts.
            dead = set(seq.host_block_ids)
            self._swap_out = [(d, h) for d, h in self._swap_out if h not in dead]
            self._host_to_release += seq.host_block_ids
            seq.host_block_ids = []
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop
        req = seq.request
        return EngineCoreOutput(req.request_id, seq.index, [], None, reason, stop, req.first_scheduled_time,
                                req.num_preemptions)

    def _forget(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is not None:
            self.policy.request_finished(request)
