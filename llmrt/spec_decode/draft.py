"""Draft-model proposals: a smaller checkpoint with the target's vocabulary, run by the same machinery.

Its KV lives in tensors of its own, indexed by the target's block tables: it sees every forward batch the
target runs (so its KV is computed for exactly the tokens the target computed), then proposes k tokens for
all sequences at once, one batched single-token pass per position, drawing each proposal from its own
distribution under the request's sampling settings (argmax for greedy requests).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from llmrt.attention import build_common_metadata
from llmrt.config import EngineConfig, ModelConfig, SpeculativeConfig
from llmrt.errors import UnsupportedError
from llmrt.model.layers.sampler import SamplingMetadata, target_probabilities
from llmrt.spec_decode.base import ProposalInput, Proposer

if TYPE_CHECKING:
    from llmrt.worker.model_runner import ModelRunner


def draft_engine_config(config: EngineConfig) -> EngineConfig:
    """The draft's own EngineConfig: its checkpoint in the target's dtype and context, no speculation."""
    spec = config.speculative
    dtype = str(config.model.torch_dtype).replace("torch.", "")
    model = ModelConfig(str(spec.speculative_model), dtype=dtype, seed=config.model.seed)
    limit = model.derived_max_len()
    if limit < int(config.model.max_model_len):
        raise UnsupportedError(f"the draft model {spec.speculative_model!r} has a context of {limit} tokens, shorter "
                               f"than the target's max_model_len {config.model.max_model_len}; lower --max-model-len "
                               "or choose another draft", param="speculative_model")
    model.max_model_len = config.model.max_model_len
    return dataclasses.replace(config, model=model, speculative=SpeculativeConfig())


def check_same_vocabulary(target_dir: str, draft_dir: str, target_vocab: int, draft_vocab: int) -> None:
    """Refuse a draft whose vocabulary differs from the target's (size, or the token -> id map)."""
    if target_vocab != draft_vocab:
        raise UnsupportedError(f"the draft model's vocabulary has {draft_vocab} tokens, the target's {target_vocab}: "
                               "a draft must share the target's tokenizer", param="speculative_model")
    vocabs = []
    for d in (target_dir, draft_dir):
        f = Path(d) / "tokenizer.json"
        vocabs.append(json.loads(f.read_text()).get("model", {}).get("vocab") if f.is_file() else None)
    if vocabs[0] is not None and vocabs[1] is not None and vocabs[0] != vocabs[1]:
        raise UnsupportedError("the draft model's tokenizer maps tokens to other ids than the target's: a draft "
                               "must share the target's tokenizer", param="speculative_model")


class DraftModelProposer(Proposer):
    """Proposes with a small model that shares the target's KV block tables."""

    name = "draft"

    def __init__(self, config: EngineConfig, target: "ModelRunner"):
        from llmrt.worker.model_runner import ModelRunner

        self.k = config.speculative.num_speculative_tokens
        self.runner = ModelRunner(draft_engine_config(config), target.device)
        check_same_vocabulary(config.model.model, str(config.speculative.speculative_model), target.vocab_size,
                              self.runner.vocab_size)
        self.block_size = target.block_size
        self._q: dict[int, torch.Tensor] = {}

    @torch.inference_mode()
    def observe_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_meta: Any) -> None:
        self.runner.model(input_ids, positions, attn_meta)

    @torch.inference_mode()
    def propose(self, inputs: list[ProposalInput]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in inputs]
        q_rows: dict[int, list[torch.Tensor]] = {}
        model, device, backend = self.runner.model, self.runner.device, self.runner.attn_backend
        for j in range(max((inp.max_proposals for inp in inputs), default=0)):
            rows = [i for i, inp in enumerate(inputs) if j < inp.max_proposals]
            current = [(inputs[i].token_ids + out[i]) for i in rows]
            positions = torch.tensor([len(t) - 1 for t in current], dtype=torch.long)
            common = build_common_metadata([inputs[i].block_ids for i in rows], [1] * len(rows),
                                           [len(t) for t in current], positions, len(rows), self.block_size, device)
            hidden = model(torch.tensor([t[-1] for t in current], device=device), positions.to(device),
                           backend.build_metadata(common))
            logits = model.compute_logits(hidden)
            ins = [inputs[i] for i in rows]
            meta = SamplingMetadata.build([x.params for x in ins], [x.token_ids[:x.num_prompt_tokens] for x in ins],
                                          [t[x.num_prompt_tokens:] for x, t in zip(ins, current)],
                                          [x.generator for x in ins], self.runner.vocab_size, device)
            probs = target_probabilities(logits, meta)
            greedy = probs.argmax(dim=-1).tolist()
            for r, i in enumerate(rows):
                inp = inputs[i]
                if inp.params.greedy:
                    out[i].append(greedy[r])
                else:
                    out[i].append(int(torch.multinomial(probs[r], 1, generator=inp.generator).item()))
                    q_rows.setdefault(inp.seq_id, []).append(probs[r])
        self._q = {sid: torch.stack(rows) for sid, rows in q_rows.items()}
        return out

    def draft_probs(self, seq_id: int) -> Optional[torch.Tensor]:
        return self._q.get(seq_id)
