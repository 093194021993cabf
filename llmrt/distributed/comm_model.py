"""A cost model of tensor- and pipeline-parallel communication, from the model shape and a link's speed.

Tensor parallel: every forward pass all-reduces the hidden state of each token once after the embedding and
twice per layer (attention output, MLP output), and rank 0 gathers the other ranks' logits for the sampled
rows. A ring all-reduce of n bytes over p ranks costs 2(p-1) latencies and moves 2(p-1)/p * n bytes per rank.
Pipeline parallel: each stage boundary sends one hidden state per token (two for the Llama family: hidden and
residual; latency + bytes / bandwidth), the last stage sends the sampled rows' float32 logits back to rank 0,
and a step of m micro-batches leaves (pp-1)/(m+pp-1) of every stage idle (the bubble).
Compute is bounded below by reading the rank's weights once (memory bandwidth) and by 2 FLOPs per parameter per
token (device FLOP/s); the estimate takes the larger.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Link:
    """An interconnect: bytes per second and the fixed cost of one message."""

    bandwidth: float
    latency: float

    def send(self, nbytes: float) -> float:
        """Seconds to move `nbytes` in one message."""
        return self.latency + nbytes / self.bandwidth

    def all_reduce(self, nbytes: float, ranks: int) -> float:
        """Seconds of a ring all-reduce of `nbytes` over `ranks`."""
        if ranks == 1:
            return 0.0
        return 2 * (ranks - 1) * self.latency + 2 * (ranks - 1) / ranks * nbytes / self.bandwidth

    def gather(self, nbytes_per_rank: float, ranks: int) -> float:
        """Seconds for rank 0 to receive every other rank's `nbytes_per_rank`."""
        return (ranks - 1) * self.send(nbytes_per_rank) if ranks > 1 else 0.0


@dataclass(frozen=True)
class Device:
    """What bounds one rank's compute: memory bandwidth (B/s) and dense FLOP/s."""

    bandwidth: float
    flops: float


@dataclass
class StepEstimate:
    """One step's estimated compute and communication per rank."""

    tokens: int
    sampled_rows: int
    compute_seconds: float
    tp_seconds: float
    pp_seconds: float
    bubble_share: float
    comm_bytes_per_token: float

    @property
    def comm_share(self) -> float:
        """Share of the step spent communicating (serial: nothing overlaps)."""
        total = self.compute_seconds + self.tp_seconds + self.pp_seconds
        return (self.tp_seconds + self.pp_seconds) / total if total else 0.0

    def as_dict(self) -> dict[str, Any]:
        """Every figure, with the share."""
        return {**asdict(self), "comm_share": self.comm_share}


def estimate_step(hf_config: dict[str, Any], *, tp: int, pp: int, link: Link, device: Device, elem_bytes: int,
                  params: int, tokens: int, sampled_rows: int, micro_batches: int = 1) -> StepEstimate:
    """Estimate one step of `tokens` tokens sampling `sampled_rows` rows for a model of `params` parameters."""
    c = hf_config
    hidden = c.get("hidden_size") or c["n_embd"]
    layers = c.get("num_hidden_layers") or c["n_layer"]
    vocab = c["vocab_size"]
    per_rank_params = params / (tp * pp)
    compute = max(per_rank_params * elem_bytes / device.bandwidth, 2 * per_rank_params * tokens / device.flops)
    row = tokens * hidden * elem_bytes
    stage_layers = -(-layers // pp)
    tp_s = 0.0
    tp_bytes = 0.0
    if tp > 1:
        reduces = 2 * stage_layers + 1
        tp_s = reduces * link.all_reduce(row, tp) + link.gather(sampled_rows * -(-vocab // tp) * 4, tp)
        tp_bytes = reduces * 2 * (tp - 1) / tp * row + (tp - 1) * sampled_rows * -(-vocab // tp) * 4
    pp_s = 0.0
    pp_bytes = 0.0
    bubble = 0.0
    if pp > 1:
        m = max(1, micro_batches)
        carry = row * (1 if "n_embd" in c else 2)  # the Llama family also hands on its residual stream
        logits = sampled_rows * vocab * 4  # float32 logits from the last stage back to rank 0, which samples
        pp_s = (pp - 1) * m * link.send(carry / m) + link.send(logits)
        pp_bytes = (pp - 1) * carry + logits
        bubble = (pp - 1) / (m + pp - 1)
    return StepEstimate(tokens, sampled_rows, compute, tp_s, pp_s, bubble,
                        (tp_bytes + pp_bytes) / max(tokens, 1))
