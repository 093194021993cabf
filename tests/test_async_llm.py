"""AsyncLLM with the engine core in its own process: streaming, abort, deadlines, faults, admission."""
from __future__ import annotations

import asyncio
import os
import signal

import pytest

from llmrt import LLM, SamplingParams
from llmrt.config import EngineConfig
from llmrt.engine.async_llm import AsyncLLM
from llmrt.errors import CapacityExceededError, DeadlineExceededError, EngineDeadError

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(max_tokens=40, temperature=0)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=120))


async def _engine(**kw) -> AsyncLLM:
    engine_kw = {k: kw.pop(k) for k in list(kw) if k in ("max_num_seqs", "block_size", "num_gpu_blocks_override")}
    eng = AsyncLLM(EngineConfig.create(None, dtype="float32", **engine_kw), enable_fault_injection=True, **kw)
    await eng.start()
    return eng


async def _collect(eng: AsyncLLM, prompt, params, rid: str, **kw):
    last = None
    async for out in eng.generate(prompt, params, rid, **kw):
        last = out
    return last


async def _wait_idle(eng: AsyncLLM) -> dict:
    for _ in range(200):
        st = eng.stats()
        if st.get("kv_blocks_free") == st.get("kv_blocks_total") and st.get("num_running") == 0:
            return st
        await asyncio.sleep(0.05)
    return eng.stats()


def test_stream_matches_offline_and_frees_blocks():
    expected = LLM(dtype="float32").generate("Once upon a time", GREEDY)[0].outputs[0]

    async def main():
        eng = await _engine()
        try:
            texts = []
            async for out in eng.generate("Once upon a time", GREEDY, "r1"):
                texts.append(out.outputs[0].text)
            assert out.finished and out.outputs[0].token_ids == expected.token_ids
            assert texts[-1] == expected.text and len(texts) > 5
            assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # cumulative
            assert out.metrics.ttft is not None and out.metrics.queue_time is not None
            st = await _wait_idle(eng)
            assert st["kv_blocks_free"] == st["kv_blocks_total"]
            assert eng.health() == (True, "ok")
        finally:
            await eng.shutdown()
    run(main())


def test_final_only_outputs_for_plain_requests():
    """stream=False yields one output, the finished one, equal to a streamed request's last (stop strings still
    cut the text: they are found step by step in the front end)."""
    params = SamplingParams(max_tokens=40, temperature=0, stop=["little"])

    async def main():
        eng = await _engine()
        try:
            streamed = [out async for out in eng.generate("Once upon a time", params, "s")]
            plain = [out async for out in eng.generate("Once upon a time", params, "p", stream=False)]
            assert len(streamed) > 1 and len(plain) == 1 and plain[0].finished
            a, b = streamed[-1].outputs[0], plain[0].outputs[0]
            assert (b.text, b.token_ids, b.finish_reason, b.stop_reason) == (a.text, a.token_ids, a.finish_reason,
                                                                             a.stop_reason)
            assert b.finish_reason == "stop" and b.stop_reason == "little"
            assert plain[0].metrics.ttft is not None and plain[0].metrics.inter_token_latencies
        finally:
            await eng.shutdown()
    run(main())


def test_consumer_leaving_aborts_and_frees_blocks():
    async def main():
        eng = await _engine()
        try:
            gen = eng.generate("Once upon a time", SamplingParams(max_tokens=400, temperature=0, ignore_eos=True), "a")
            n = 0
            async for _ in gen:
                n += 1
                if n == 3:
                    break
            await gen.aclose()
            st = await _wait_idle(eng)
            assert st["kv_blocks_free"] == st["kv_blocks_total"] and st["num_running"] == 0
            out = await _collect(eng, "Once upon a time", GREEDY, "b")
            assert out.finished
        finally:
            await eng.shutdown()
    run(main())


def test_queued_request_past_deadline_gets_408_without_compute():
    async def main():
        eng = await _engine(max_num_seqs=1)
        try:
            started = asyncio.Event()

            async def long_request():
                last = None
                async for last in eng.generate("Once upon a time",
                                               SamplingParams(max_tokens=300, temperature=0, ignore_eos=True), "long"):
                    started.set()
                return last
            long = asyncio.create_task(long_request())
            await started.wait()
            # The long request holds the only slot; a stalled step makes sure it still does when `late` times out,
            # however fast this machine decodes.
            await eng.inject_fault("stall", 1.5)
            with pytest.raises(DeadlineExceededError, match="still queued"):
                await _collect(eng, "Lily", GREEDY, "late", timeout=0.3)
            out = await long
            assert len(out.outputs[0].token_ids) == 300
        finally:
            await eng.shutdown()
    run(main())


def test_engine_death_fails_streams_and_health():
    async def main():
        eng = await _engine()
        try:
            gen = eng.generate("Once upon a time", SamplingParams(max_tokens=400, temperature=0, ignore_eos=True), "x")
            with pytest.raises(EngineDeadError):
                n = 0
                async for _ in gen:
                    n += 1
                    if n == 2:
                        os.kill(eng.stats()["engine_pid"], signal.SIGKILL)
            healthy, reason = eng.health()
            assert not healthy and "died" in reason
            with pytest.raises(EngineDeadError):
                await _collect(eng, "Lily", GREEDY, "after")
        finally:
            await eng.shutdown()
    run(main())


def test_stalled_step_makes_health_fail_while_it_lasts():
    async def main():
        eng = await _engine(health_step_timeout=0.5)
        try:
            await eng.inject_fault("stall", 2.5)
            task = asyncio.create_task(_collect(eng, "Once upon a time", GREEDY, "s"))
            await asyncio.sleep(1.5)
            assert eng.health()[0] is False
            out = await task
            assert out.finished and eng.health() == (True, "ok")
        finally:
            await eng.shutdown()
    run(main())


def test_oom_in_a_step_is_absorbed():
    expected = LLM(dtype="float32").generate(["Once upon a time", "Lily and Tom"], GREEDY)

    async def main():
        eng = await _engine()
        try:
            await eng.inject_fault("stall", 0.5)  # holds the first step until both requests are there
            await eng.inject_fault("oom")
            t1 = asyncio.create_task(_collect(eng, "Once upon a time", GREEDY, "o1"))
            t2 = asyncio.create_task(_collect(eng, "Lily and Tom", GREEDY, "o2"))
            outs = await asyncio.gather(t1, t2)
            assert [o.outputs[0].token_ids for o in outs] == [e.outputs[0].token_ids for e in expected]
            assert eng.stats()["num_preemptions"] >= 1  # the failed step was absorbed by preempting
        finally:
            await eng.shutdown()
    run(main())


def test_full_queue_refuses_with_retry_after():
    async def main():
        eng = await _engine(max_num_seqs=1, max_waiting_requests=3)
        try:
            params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
            tasks = [asyncio.create_task(_collect(eng, "Once upon a time", params, f"q{i}")) for i in range(15)]
            results = await asyncio.gather(*tasks, return_exceptions=True)
            refused = [r for r in results if isinstance(r, CapacityExceededError)]
            done = [r for r in results if not isinstance(r, Exception)]
            assert len(refused) + len(done) == 15 and refused and len(done) >= 3
            assert all(e.retry_after >= 1 and e.http_status == 429 for e in refused)
            assert all(len(o.outputs[0].token_ids) == 60 for o in done)
            assert eng.health() == (True, "ok")
        finally:
            await eng.shutdown()
    run(main())
