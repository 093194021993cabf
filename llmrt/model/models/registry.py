"""Model families keyed by the HF `architectures` name."""
from __future__ import annotations

from llmrt.errors import UnsupportedError
from llmrt.model.models.base import CausalLM
from llmrt.model.models.gpt2 import GPT2LMHeadModel
from llmrt.model.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
}


def resolve_architecture(name: str) -> type[CausalLM]:
    """The model class for an HF architecture name, or UnsupportedError listing what is supported."""
    if name not in MODEL_REGISTRY:
        raise UnsupportedError(
            f"architecture {name or '(none in config.json)'!r} is not supported; "
            f"supported: {', '.join(sorted(MODEL_REGISTRY))}"
        )
    return MODEL_REGISTRY[name]
