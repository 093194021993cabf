"""Which tensor-parallel sizes a model can be split into, checked at start-up with the numbers named."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmrt.errors import UnsupportedError


@dataclass(frozen=True)
class SplitDims:
    """The dimensions tensor parallelism splits: query heads, KV heads and the MLP width."""

    heads: int
    kv_heads: int
    intermediate: int

    @classmethod
    def of(cls, hf_config: dict[str, Any], architecture: str) -> "SplitDims":
        """Read them from an HF config.json of a supported architecture."""
        c = hf_config
        if architecture == "GPT2LMHeadModel":
            return cls(c["n_head"], c["n_head"], c.get("n_inner") or 4 * c["n_embd"])
        heads = c["num_attention_heads"]
        return cls(heads, c.get("num_key_value_heads") or heads, c["intermediate_size"])

    def fits(self, tp: int) -> bool:
        """Every rank gets a whole share of heads and MLP; KV heads divide the ranks or are divided by them."""
        kv_ok = self.kv_heads % tp == 0 or tp % self.kv_heads == 0
        return self.heads % tp == 0 and self.intermediate % tp == 0 and kv_ok

    def valid_sizes(self) -> list[int]:
        """Every tensor-parallel size this model can be split into."""
        return [n for n in range(1, self.heads + 1) if self.fits(n)]


def check_tensor_parallel(hf_config: dict[str, Any], architecture: str, tp: int) -> None:
    """Refuse a size the model cannot be split into, naming its heads, KV heads, MLP width and the valid sizes."""
    if tp == 1:
        return
    dims = SplitDims.of(hf_config, architecture)
    if not dims.fits(tp):
        raise UnsupportedError(
            f"--tensor-parallel-size {tp} does not split this model: it has {dims.heads} attention heads, "
            f"{dims.kv_heads} KV heads and an MLP width of {dims.intermediate} (every rank needs a whole share of "
            f"the heads and the MLP, and the KV heads must divide or be divided by the ranks); valid sizes: "
            f"{', '.join(map(str, dims.valid_sizes()))}", param="tensor_parallel_size")


def num_layers(hf_config: dict[str, Any]) -> int:
    """Decoder layers of an HF config (Llama family or GPT-2)."""
    return int(hf_config.get("num_hidden_layers") or hf_config["n_layer"])


def check_pipeline_parallel(hf_config: dict[str, Any], architecture: str, pp: int) -> None:
    """Refuse a stage count that does not cut the layers into equal contiguous stages, naming the valid ones."""
    if pp == 1:
        return
    layers = num_layers(hf_config)
    if pp > layers or layers % pp:
        valid = [n for n in range(1, layers + 1) if layers % n == 0]
        raise UnsupportedError(
            f"--pipeline-parallel-size {pp} does not split this model: it has {layers} decoder layers (every stage "
            f"needs the same whole number of layers); valid sizes: {', '.join(map(str, valid))}",
            param="pipeline_parallel_size")
