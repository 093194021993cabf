"""One pipelined forward pass: the step cut into micro-batches that flow through the stages GPipe-style.

Every rank gets the same StepInput and cuts it the same way (contiguous groups of sequences, balanced by tokens;
a chunked prefill is one unit). Stage s runs micro-batch i as soon as stage s-1 has sent it, so stage s works on i
while stage s+1 works on i-1; sends are asynchronous. The last stage computes each micro-batch's logits rows
(gathered over its tensor-parallel ranks) and its tp rank 0 sends them to rank 0, which puts them back in the
step's row order and samples. After the step every other stage reports its waiting and total seconds to rank 0.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from llmrt.distributed.pipeline import TAG_CARRY, TAG_LOGITS, TAG_TIMES, StageTimes
from llmrt.engine.step import StepInput

if TYPE_CHECKING:
    from llmrt.worker.model_runner import ModelRunner


@dataclass
class MicroBatch:
    """A contiguous group of the step's sequences, as its own StepInput, and where its logits rows go."""

    inp: StepInput
    row_slots: list[int]  # for each of inp.logits_rows, its index in the step's logits_rows


def num_micro_batches(configured: int, stages: int, num_seqs: int) -> int:
    """Micro-batches for a step of `num_seqs` sequences: the configured count (0: one per stage), at most one
    per sequence."""
    return max(1, min(configured or stages, num_seqs))


def split_micro_batches(inp: StepInput, m: int) -> list[MicroBatch]:
    """Cut `inp` into `m` contiguous groups of sequences with about equal tokens (each at least one sequence)."""
    n = len(inp.query_lens)
    m = max(1, min(m, n))
    total = sum(inp.query_lens)
    cuts: list[int] = []
    acc = 0
    for i, q in enumerate(inp.query_lens):
        need = m - 1 - len(cuts)
        if need == 0:
            break
        acc += q
        if acc >= total * (len(cuts) + 1) / m or n - (i + 1) == need:
            cuts.append(i + 1)
    starts = [0]
    for q in inp.query_lens:
        starts.append(starts[-1] + q)
    out = []
    for a, b in zip([0] + cuts, cuts + [n]):
        t0, t1 = starts[a], starts[b]
        slots = [j for j, r in enumerate(inp.logits_rows) if t0 <= r < t1]
        sub = StepInput(inp.input_ids[t0:t1], inp.positions[t0:t1], inp.block_tables[a:b], inp.query_lens[a:b],
                        inp.seq_lens[a:b], max(0, min(b, inp.num_decodes) - a),
                        [inp.logits_rows[j] - t0 for j in slots])
        out.append(MicroBatch(sub, slots))
    return out


def pipelined_forward(runner: "ModelRunner", inp: StepInput) -> Optional[torch.Tensor]:
    """This rank's stage of the step; rank 0 returns the logits of `inp.logits_rows` (None when there are none),
    every other rank None."""
    pipe, model = runner.pipe, runner.model
    assert pipe is not None
    stage = pipe.stage
    start = time.perf_counter()
    hidden = model.hf_config.get("hidden_size") or model.hf_config["n_embd"]
    mbs = split_micro_batches(inp, num_micro_batches(runner.config.parallel.pipeline_micro_batches, stage.size,
                                                     len(inp.query_lens)))
    for mb in mbs:
        ids, pos, meta = runner.model_inputs(mb.inp)
        carry = None
        if not stage.is_first:
            carry = pipe.recv((model.carry_rows, len(mb.inp.input_ids), hidden), model.compute_dtype,
                              pipe.stage_rank(stage.index - 1), TAG_CARRY)
        out = model(ids, pos, meta, carry)
        if not stage.is_last:
            pipe.send(out.to(model.compute_dtype), pipe.stage_rank(stage.index + 1), TAG_CARRY)
        elif mb.inp.logits_rows:
            logits = model.compute_logits(out[torch.tensor(mb.inp.logits_rows, dtype=torch.long, device=out.device)])
            if logits is not None:  # this stage's tp rank 0
                pipe.send(logits, 0, TAG_LOGITS)
    result = None
    if pipe.rank == 0 and inp.logits_rows:
        result = torch.empty(len(inp.logits_rows), runner.vocab_size, dtype=torch.float32, device=runner.device)
        last = pipe.stage_rank(stage.size - 1, 0)
        for mb in mbs:
            if mb.row_slots:
                part = pipe.recv((len(mb.row_slots), runner.vocab_size), torch.float32, last, TAG_LOGITS)
                result[torch.tensor(mb.row_slots, dtype=torch.long, device=runner.device)] = part
    pipe.finish_sends()
    pipe.times.total += time.perf_counter() - start
    _report_times(runner)
    return result


def _report_times(runner: "ModelRunner") -> None:
    """Every stage's tp rank 0 sends its step's (wait, total) seconds to rank 0, which keeps them per stage."""
    pipe = runner.pipe
    assert pipe is not None
    if pipe.tp_rank != 0:
        pipe.take_times()
        return
    if pipe.rank != 0:
        t = pipe.take_times()
        pipe.send(torch.tensor([t.wait, t.total], dtype=torch.float64, device=runner.device), 0, TAG_TIMES)
        pipe.finish_sends()  # tiny: rank 0 takes it at once
        return
    own = pipe.take_times()
    stages = [own]
    for s in range(1, pipe.stage.size):
        t = pipe.recv((2,), torch.float64, pipe.stage_rank(s, 0), TAG_TIMES).tolist()
        stages.append(StageTimes(t[0], t[1]))
    pipe.times = StageTimes()  # the receives above are bookkeeping, not the step's waiting
    runner.stage_times = stages
