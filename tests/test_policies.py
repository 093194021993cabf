"""Scheduling policies, deterministically: the real Scheduler and BlockManager, with a stand-in for the model
that samples token 7 for every row (the scheduler's decisions do not depend on which token comes out)."""
from __future__ import annotations

from collections import Counter
from typing import Optional

import pytest

from llmrt.config import SCHEDULING_POLICIES, EngineConfig, SchedulerConfig
from llmrt.engine.kv_cache import BlockManager, HostBlockPool
from llmrt.engine.policies import make_policy
from llmrt.engine.request import Request
from llmrt.engine.scheduler import Scheduler
from llmrt.engine.step import ModelRunnerOutput, SchedulerOutput
from llmrt.errors import InvalidRequestError, UnsupportedError
from llmrt.sampling_params import SamplingParams


def make_scheduler(policy: str, *, num_blocks: int = 256, block_size: int = 4, max_num_seqs: int = 64,
                   budget: int = 64, watermark: float = 0.0, aging: int = 32, swap_blocks: Optional[int] = None,
                   ) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, policy=policy,
                          kv_watermark=watermark, short_first_aging_steps=aging,
                          preemption_mode="swap" if swap_blocks is not None else "recompute")
    pool = HostBlockPool(swap_blocks) if swap_blocks is not None else None
    return Scheduler(cfg, BlockManager(num_blocks, block_size), max_model_len=4096, host_pool=pool)


def add(s: Scheduler, rid: str, prompt_len: int, max_tokens: int, priority: int = 0,
        user: Optional[str] = None) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    req = Request(rid, [3 + (sum(map(ord, rid)) + i) % 500 for i in range(prompt_len)], params, 0.0, max_tokens, priority,
                  user=user)
    s.add_request(req)
    return req


def step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    sampled = [[7] * item.num_samples for item in out.scheduled if item.num_samples]
    s.update(out, ModelRunnerOutput(sampled))
    return out


def first_scheduled_order(s: Scheduler, max_steps: int = 500) -> list[str]:
    order: list[str] = []
    for _ in range(max_steps):
        if not s.has_unfinished():
            break
        for item in step(s).scheduled:
            rid = item.seq.request.request_id
            if rid not in order:
                order.append(rid)
    assert not s.has_unfinished()
    return order


def test_every_configured_policy_has_an_implementation():
    for name in SCHEDULING_POLICIES:
        assert make_policy(SchedulerConfig(policy=name)).name == name


def test_bad_scheduler_settings_are_refused():
    with pytest.raises(UnsupportedError, match="supported: fcfs, priority, short-first, fair"):
        SchedulerConfig(policy="lottery")
    with pytest.raises(InvalidRequestError):
        SchedulerConfig(preemption_mode="drop")
    with pytest.raises(InvalidRequestError):
        SchedulerConfig(kv_watermark=1.5)
    with pytest.raises(UnsupportedError):
        EngineConfig.create(None, scheduling_policy="nope")


def test_fcfs_runs_in_arrival_order():
    s = make_scheduler("fcfs", max_num_seqs=1)
    for rid, n in (("a", 30), ("b", 4), ("c", 12)):
        add(s, rid, n, 2)
    assert first_scheduled_order(s) == ["a", "b", "c"]


def test_priority_orders_by_priority_then_arrival():
    s = make_scheduler("priority", max_num_seqs=1)
    for rid, prio in (("a", 2), ("b", 0), ("c", 1), ("d", 0), ("e", 2)):
        add(s, rid, 6, 2, priority=prio)
    assert first_scheduled_order(s) == ["b", "d", "c", "a", "e"]


def test_priority_preempts_a_lower_priority_running_request():
    s = make_scheduler("priority", max_num_seqs=1)
    low = add(s, "low", 6, 20, priority=5)
    step(s)
    step(s)
    assert [q.request.request_id for q in s.running] == ["low"]
    add(s, "high", 6, 3, priority=0)
    out = step(s)
    assert [item.seq.request.request_id for item in out.scheduled] == ["high"]
    assert low.num_preemptions == 1 and out.num_preempted == 1
    # An equal priority never preempts.
    add(s, "peer", 6, 3, priority=0)
    out = step(s)
    assert [item.seq.request.request_id for item in out.scheduled] == ["high"]
    assert first_scheduled_order(s) == ["high", "peer", "low"]


def test_short_first_orders_by_remaining_prompt():
    s = make_scheduler("short-first", max_num_seqs=1, aging=1000)
    for rid, n in (("a", 30), ("b", 4), ("c", 12), ("d", 8)):
        add(s, rid, n, 2)
    assert first_scheduled_order(s) == ["b", "d", "c", "a"]


def _steps_passed_over(aging: int, horizon: int = 40) -> Optional[int]:
    """A long request arrives with a steady stream of short ones that alone fill every step's budget; the
    number of steps until it is first scheduled (None if never within the horizon)."""
    s = make_scheduler("short-first", budget=8, aging=aging)
    add(s, "long", 40, 1)
    arrival = s.step
    for i in range(horizon):
        add(s, f"s{i}a", 4, 1)
        add(s, f"s{i}b", 4, 1)
        if any(item.seq.request.request_id == "long" for item in step(s).scheduled):
            return s.step - arrival
    return None


def test_short_first_aging_bounds_the_wait_behind_later_arrivals():
    for aging in (3, 5, 9):
        waited = _steps_passed_over(aging)
        assert waited is not None and waited <= aging, (aging, waited)
    assert _steps_passed_over(10_000) is None  # without aging the stream starves it: the bound is the aging's doing


def _tokens_by_user(policy: str, steps: int) -> Counter:
    s = make_scheduler(policy, max_num_seqs=4, budget=64)
    for i in range(30):  # the heavy user queues everything first
        add(s, f"a{i}", 8, 16, user="heavy")
    for i in range(30):
        add(s, f"b{i}", 8, 16, user="light")
    served: Counter = Counter()
    for _ in range(steps):
        for item in step(s).scheduled:
            served[item.seq.request.user] += item.num_new_tokens
    return served


def test_fair_shares_tokens_across_users_within_ten_percent():
    served = _tokens_by_user("fair", 60)
    total = served["heavy"] + served["light"]
    assert total > 0
    assert abs(served["heavy"] - served["light"]) <= 0.1 * total / 2, served
    fcfs = _tokens_by_user("fcfs", 60)
    assert fcfs["light"] < 0.1 * fcfs["heavy"]  # first come, first served lets the heavy user take it all


def test_fair_newcomer_starts_from_the_current_share():
    s = make_scheduler("fair", max_num_seqs=2, budget=64)
    add(s, "a0", 8, 40, user="old")
    for _ in range(20):
        step(s)
    add(s, "b0", 8, 4, user="new")
    policy = s.policy
    assert policy.served["new"] == policy.served["old"]  # not zero: it may not monopolise to catch up


def test_watermark_stops_admissions_before_running_requests_run_out():
    s = make_scheduler("fcfs", num_blocks=20, block_size=4, watermark=0.25)  # keep 5 blocks free
    add(s, "a", 16, 8)  # 4 blocks, admitted alone whatever the watermark
    step(s)
    add(s, "b", 40, 8)  # 10 blocks: 20 - 5 - 10 = 5 >= 5 reserve -> fits
    add(s, "c", 8, 8)  # 2 more would leave 3 < 5: waits
    out = step(s)
    assert {item.seq.request.request_id for item in out.scheduled} == {"a", "b"}
    assert s.block_manager.num_free_blocks >= 5 and s.num_waiting == 1


def test_running_decodes_go_first_and_prefill_is_chunked():
    s = make_scheduler("fcfs", budget=16)
    add(s, "a", 4, 30)
    step(s)
    add(s, "long", 100, 2)
    out = step(s)
    assert [(i.seq.request.request_id, i.num_new_tokens) for i in out.scheduled] == [("a", 1), ("long", 15)]


@pytest.mark.parametrize("policy", SCHEDULING_POLICIES)
def test_memory_pressure_preempts_by_policy_and_finishes_everything(policy):
    s = make_scheduler(policy, num_blocks=12, block_size=4, max_num_seqs=8)
    for i in range(6):
        add(s, f"r{i}", 6, 12, priority=i % 3, user=f"u{i % 2}")
    order = first_scheduled_order(s)
    assert sorted(order) == [f"r{i}" for i in range(6)]
    assert s.num_preemptions_total > 0
    assert s.block_manager.num_free_blocks == 12


def test_swap_mode_moves_kv_out_and_back_without_recompute():
    s = make_scheduler("fcfs", num_blocks=8, block_size=4, max_num_seqs=4, swap_blocks=16)
    a = add(s, "a", 6, 20)
    b = add(s, "b", 6, 20)
    outs = []
    while s.has_unfinished():
        outs.append(step(s))
    swap_out = [p for o in outs for p in o.swap_out]
    swap_in = [p for o in outs for p in o.swap_in]
    assert swap_out and swap_in and s.num_swaps_out > 0
    assert sorted(h for _, h in swap_out) != [] and {h for h, _ in swap_in} <= {h for _, h in swap_out}
    # A swapped-in sequence continues where it stopped: its prompt is never computed twice.
    computed = Counter()
    for o in outs:
        for item in o.scheduled:
            computed[item.seq.request.request_id] += item.num_new_tokens
    assert computed["a"] == 6 + 19 and computed["b"] == 6 + 19
    assert a.num_preemptions + b.num_preemptions > 0
    assert s.block_manager.num_free_blocks == 8
    s.schedule()  # releases the host blocks of the last swap-in
    assert s.host_pool.num_free_blocks == 16


def test_swap_falls_back_to_recompute_when_the_host_pool_is_full():
    s = make_scheduler("fcfs", num_blocks=8, block_size=4, max_num_seqs=4, swap_blocks=0)
    add(s, "a", 6, 20)
    add(s, "b", 6, 20)
    outs = []
    while s.has_unfinished():
        outs.append(step(s))
    assert s.num_preemptions_total > 0 and s.num_swaps_out == 0
    assert not any(o.swap_out for o in outs)


@pytest.mark.parametrize("policy", ["fcfs", "short-first", "fair"])
def test_a_long_queue_costs_linear_rank_calls_once_admissions_stop(policy):
    # 2000 waiting requests, room for a few: once one does not fit, the rest must not be scanned again and again.
    s = make_scheduler(policy, num_blocks=64, block_size=16, budget=2048)
    for i in range(2000):
        add(s, f"r{i}", 100, 8)
    calls = 0
    rank = s.policy.rank

    def counting_rank(seq, step):
        nonlocal calls
        calls += 1
        return rank(seq, step)

    s.policy.rank = counting_rank
    out = s.schedule()
    assert 0 < len(out.scheduled) < 2000
    assert calls < 3 * 2000 * (len(out.scheduled) + 1)  # one scan per admission, not one per waiting request
