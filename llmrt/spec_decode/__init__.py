"""Speculative decoding: proposers by method name (a new one is one file plus a line here) and verification."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

from llmrt.config import EngineConfig
from llmrt.spec_decode.base import ProposalInput, Proposer
from llmrt.spec_decode.draft import DraftModelProposer
from llmrt.spec_decode.ngram import NgramProposer

if TYPE_CHECKING:
    from llmrt.worker.model_runner import ModelRunner

PROPOSERS: dict[str, Callable[[EngineConfig, "ModelRunner"], Proposer]] = {
    NgramProposer.name: lambda config, target: NgramProposer(config.speculative),
    DraftModelProposer.name: DraftModelProposer,
}


def create_proposer(config: EngineConfig, target: "ModelRunner") -> Optional[Proposer]:
    """The configured proposer, or None when speculation is off."""
    method = config.speculative.method
    return PROPOSERS[method](config, target) if method else None


__all__ = ["PROPOSERS", "ProposalInput", "Proposer", "create_proposer"]
