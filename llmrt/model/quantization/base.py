"""The quantization seam: a config chooses the LinearMethod of every Linear it is handed."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from llmrt.model.layers.linear import Linear, LinearMethod


class QuantizationConfig(ABC):
    """A weight format (int8, int4, fp8, GGUF, ...): reaches every Linear through the model constructor."""

    name: ClassVar[str]

    @abstractmethod
    def linear_method(self, layer: "Linear") -> "LinearMethod":
        """The method that creates and applies `layer`'s weights."""

    def lm_head_config(self) -> "QuantizationConfig | None":
        """The format of the LM head (None: the model dtype, the default for formats that do not say)."""
        return None

    def weight_bytes(self, out_features: int, in_features: int) -> int:
        """Bytes one [out, in] weight takes once quantized, scales included (for `llmrt plan`)."""
        raise NotImplementedError

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> "QuantizationConfig":
        """Build from the engine options (and a checkpoint's quantization_config, when it has one)."""
        return cls()
