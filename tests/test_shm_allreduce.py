"""The shared-memory all-reduce between two real processes: sums of several shapes and dtypes (the same bits on
both ranks), the gather, the gloo fallback for tensors larger than the segment, and a peer that dies or hangs
mid-collective making the other raise within the timeout; the segment file never outlives start-up."""
from __future__ import annotations

import io
import multiprocessing as mp
import os
import time
import traceback

import pytest
import torch

from llmrt.distributed.shm_allreduce import PREFIX, SHM_DIR, supported_here

pytestmark = pytest.mark.skipif(not supported_here(), reason="needs an x86 CPU (total store order) and /dev/shm")

SHAPES = [(1, 768), (16, 768), (3, 5, 7), (256, 1024)]
DTYPES = [torch.float32, torch.bfloat16]


def _tensor(rank: int, shape, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + len(shape) + shape[0])
    return torch.randn(shape, generator=g).to(dtype)


def _pack(t):
    """Bytes for the queue (a tensor put on a multiprocessing queue dies with the process that put it)."""
    if t is None:
        return None
    buf = io.BytesIO()
    torch.save(t.clone(), buf)
    return buf.getvalue()


def _unpack(b):
    return None if b is None else torch.load(io.BytesIO(b))


def _rank(rank: int, port: int, scenario: str, timeout_s: float, out) -> None:
    """One rank: join with the shared-memory transport forced, run `scenario`, put its results on `out`."""
    from llmrt.distributed.parallel_state import init_distributed, shutdown_distributed

    torch.set_num_threads(1)
    try:
        comm = init_distributed(rank, 2, f"tcp://127.0.0.1:{port}", torch.device("cpu"), timeout_s, "shm")
        comm.use_step_timeout()
        out.put(("segment", rank, [p.name for p in SHM_DIR.glob(PREFIX + "*")]))
        if scenario == "sums":
            for shape in SHAPES:
                for dtype in DTYPES:
                    t = _tensor(rank, shape, dtype)
                    out.put(("sum", rank, (shape, str(dtype)), _pack(comm.all_reduce(t))))
            g = comm.gather_to_first(torch.full((2, 3), float(rank)))
            out.put(("gather", rank, None, _pack(g)))
            big = torch.ones(comm.shm.capacity // 4 + 1)  # one element over the segment: gloo carries it
            out.put(("big", rank, None, float(comm.all_reduce(big)[0])))
        else:
            comm.all_reduce(torch.ones(4))  # both arrive once
            if rank == 1:
                # Flush our queued items first: a process that exits while its queue's feeder thread holds the
                # queue's shared write lock leaves rank 0's puts blocked for good.
                out.close()
                out.join_thread()
                if scenario == "die":
                    os._exit(3)
                time.sleep(timeout_s * 4)  # "hang": alive but never arrives
                os._exit(0)
            start = time.monotonic()
            try:
                comm.all_reduce(torch.ones(4))
            except RuntimeError as e:
                out.put(("raised", rank, type(e).__name__, (str(e), time.monotonic() - start)))
            else:
                out.put(("returned", rank, None, None))
        comm.close()
        shutdown_distributed()
    except BaseException:
        out.put(("error", rank, None, traceback.format_exc()))
    out.put(("end", rank, None, None))


def _run(scenario: str, timeout_s: float = 20.0) -> tuple[list[tuple], int]:
    """Run both ranks; their results and rank 0's pid (the segment's name starts with it)."""
    from llmrt.executor.multiproc import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, scenario, timeout_s, out), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    items: list[tuple] = []
    ends = 0
    while ends < 2:  # drain before joining: a process does not exit while its queued items are unread
        item = out.get(timeout=120)
        if item[0] == "end":
            ends += 1
            if fault_rank_exits(scenario):  # the dying/hung rank 1 never reports its end
                break
        else:
            items.append(item)
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    errors = [i[3] for i in items if i[0] == "error"]
    assert not errors, errors[0]
    return items, procs[0].pid


def fault_rank_exits(scenario: str) -> bool:
    """Whether rank 1 leaves without reporting (the fault scenarios): rank 0's end is the last item then."""
    return scenario != "sums"


def _segments(pid: int) -> list:
    return list(SHM_DIR.glob(f"{PREFIX}{pid}-*"))


def test_sums_gather_and_fallback_across_two_processes():
    items, pid = _run("sums")
    sums = {(i[1], i[2]): _unpack(i[3]) for i in items if i[0] == "sum"}
    for shape in SHAPES:
        for dtype in DTYPES:
            a, b = _tensor(0, shape, dtype), _tensor(1, shape, dtype)
            expect = (a.float() + b.float()).to(dtype)
            r0, r1 = sums[(0, (shape, str(dtype)))], sums[(1, (shape, str(dtype)))]
            assert r0.dtype == dtype and r0.shape == shape
            bits = torch.int32 if dtype == torch.float32 else torch.int16
            assert torch.equal(r0.view(bits), r1.view(bits)), (shape, dtype)  # the same bits on both ranks
            assert torch.equal(r0, expect), (shape, dtype)
    gathers = {i[1]: _unpack(i[3]) for i in items if i[0] == "gather"}
    assert gathers[1] is None
    assert torch.equal(gathers[0], torch.tensor([[0.0] * 3 + [1.0] * 3] * 2))
    assert [i[3] for i in items if i[0] == "big"] == [2.0, 2.0]
    # Rank 0 unlinks the name as soon as both ranks mapped it (before its start-up returns): nothing is left in
    # /dev/shm from then on. (Rank 1 may look before rank 0 got there.)
    assert all(f"{PREFIX}{pid}-" not in " ".join(i[2]) for i in items if i[0] == "segment" and i[1] == 0)
    assert not _segments(pid)


@pytest.mark.parametrize("fault", ["die", "hang"])
def test_a_peer_that_dies_or_hangs_raises_within_the_timeout(fault):
    items, pid = _run(fault, timeout_s=2.0)
    (raised,) = [i for i in items if i[0] in ("raised", "returned")]
    assert raised[0] == "raised" and raised[2] == "CollectiveTimeout"
    message, seconds = raised[3]
    if fault == "die":
        assert "exited" in message and seconds < 2.0  # seen by the liveness check, before the timeout
    else:
        assert "timed out after 2 s" in message and 2.0 <= seconds < 2.0 + 5.0
    assert not _segments(pid)
