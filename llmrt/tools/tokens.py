"""`llmrt tokens`: what requests cost in tokens, for one or several models' tokenizers and templates.

Per request: the exact prompt length the server would see (the chat template rendered and tokenized, tools
included), split into parts: system prompt, tools schema, history (earlier turns), the last message, and the
chat template's own tokens (roles, separators, BOS; what is left when the contents are taken away). Across
requests: message contents that repeat, and whether each repeat sits in the shared prefix the prefix cache can
reuse, or is preceded by text that varies (then every request pays for it again). From the model's config.json,
estimated prefill FLOPs and KV-cache bytes (the memory-plan formulas), and how they grow with the context.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from llmrt.errors import InvalidRequestError, LLMRTError
from llmrt.tokenizer import Tokenizer, load_tokenizer
from llmrt.tools.jsonl import read_jsonl

PARTS = ("system", "tools", "history", "last_message", "template")
MIN_REPEAT_TOKENS = 16  # repeated contents shorter than this are not worth a prefix-cache finding


# ------------------------------------------------------------------------------------------------ model costs
@dataclass
class ModelCost:
    """The per-token figures a model's config.json implies (weights from the engine's own meta-device build)."""

    linear_params: int  # weights of the matmuls every prompt token goes through (not the LM head)
    lm_head_params: int  # applied to the last prompt row only during prefill
    num_layers: int
    q_dim: int  # query heads x head_dim
    kv_bytes_per_token: int
    max_model_len: int

    @classmethod
    def from_config(cls, hf_config: dict[str, Any], dtype: str = "auto") -> "ModelCost":
        """Build the model on the meta device (no weights) and read its shapes, as `llmrt plan` does."""
        from llmrt.config import context_limit, parse_dtype
        from llmrt.engine.memory_plan import plan_memory
        from llmrt.model.loader import build_model

        torch_dtype = parse_dtype(dtype, hf_config)
        plan = plan_memory(hf_config, memory_bytes=1 << 50, dtype=torch_dtype)
        model = build_model(hf_config, (hf_config.get("architectures") or [""])[0], torch_dtype, torch_dtype, "meta")
        from llmrt.model.layers.linear import Linear

        head = model.lm_head
        linear = sum(m.out_features * m.in_features for m in model.modules() if isinstance(m, Linear) and m is not head)
        spec = model.kv_cache_spec()
        heads = hf_config.get("num_attention_heads") or hf_config.get("n_head")
        return cls(linear, head.out_features * head.in_features, spec.num_layers, heads * spec.head_dim,
                   plan.kv_bytes_per_token,
                   context_limit(hf_config))

    def prefill_flops(self, tokens: int, cached: int = 0) -> float:
        """Multiply-adds x 2 of prefilling `tokens` prompt tokens, the first `cached` of them from the cache:
        the matmuls (2 x params per new token), causal attention (QK^T and PV: 2 x 2 x q_dim per visible key)
        and the LM head on the last row."""
        new = tokens - cached
        keys = (tokens * (tokens + 1) - cached * (cached + 1)) // 2  # visible keys summed over the new rows
        return 2.0 * self.linear_params * new + 4.0 * self.num_layers * self.q_dim * keys + 2.0 * self.lm_head_params

    def attention_share(self, tokens: int) -> float:
        """The fraction of prefill FLOPs spent in attention at this length (it grows linearly with context)."""
        attn = 4.0 * self.num_layers * self.q_dim * tokens * (tokens + 1) / 2
        return attn / self.prefill_flops(tokens)

    def kv_bytes(self, tokens: int) -> int:
        """KV-cache bytes a sequence of `tokens` tokens holds."""
        return tokens * self.kv_bytes_per_token


# ------------------------------------------------------------------------------------------------ one model
@dataclass
class TokenModel:
    """A tokenizer (and, where the directory has a config.json, the model's costs) under a display name."""

    name: str
    tokenizer: Tokenizer
    cost: Optional[ModelCost] = None

    @classmethod
    def load(cls, path: Optional[str], chat_template: Optional[str] = None, dtype: str = "auto") -> "TokenModel":
        """A model directory (tokenizer files, optionally config.json); None: the embedded model."""
        from llmrt.config import DEFAULT_MODEL_DIR

        directory = Path(path) if path else DEFAULT_MODEL_DIR
        tok = load_tokenizer(str(directory), chat_template)
        cost = None
        cfg = directory / "config.json"
        if cfg.is_file():
            try:
                cost = ModelCost.from_config(json.loads(cfg.read_text()), dtype)
            except (KeyError, LLMRTError, ValueError):
                cost = None  # a tokenizer-only directory or an architecture llmrt does not build: counts only
        return cls(directory.name, tok, cost)


@dataclass
class RequestTokens:
    """One request's prompt under one model: total, parts, per message, and the rendered text."""

    index: int
    kind: str  # chat | completion
    total: int = 0
    parts: dict[str, int] = field(default_factory=dict)
    messages: list[dict[str, Any]] = field(default_factory=list)  # role, content tokens, rendered tokens
    text: Optional[str] = None  # the rendered prompt (None for token-id prompts)
    token_ids: list[int] = field(default_factory=list)
    max_tokens: Optional[int] = None
    error: Optional[str] = None


def _content_tokens(tok: Tokenizer, text: str) -> int:
    return len(tok.encode(text, add_special_tokens=False)) if text else 0


def count_request(model: TokenModel, index: int, body: dict[str, Any]) -> RequestTokens:
    """Tokens of one request body (chat or completions) under `model`, split into PARTS."""
    tok = model.tokenizer
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if "messages" not in body:
        prompt = body.get("prompt")
        r = RequestTokens(index, "completion", max_tokens=max_tokens)
        try:
            text, ids = tok.encode_prompt(prompt)
        except LLMRTError as e:
            r.error = e.message
            return r
        r.text, r.token_ids, r.total = text, ids, len(ids)
        content = _content_tokens(tok, text) if text is not None else len(ids)
        r.parts = {"system": 0, "tools": 0, "history": 0, "last_message": content, "template": len(ids) - content}
        return r
    msgs, tools = body["messages"], body.get("tools") or None
    r = RequestTokens(index, "chat", max_tokens=max_tokens)
    try:
        from llmrt.tokenizer import normalize_messages

        norm = normalize_messages(msgs)
        r.text = tok.render_chat(msgs, True, tools)
        r.token_ids = tok.encode(r.text, add_special_tokens=False)
        without_tools = len(tok.apply_chat_template(msgs, True, None)) if tools else None
    except LLMRTError as e:
        r.error = e.message
        return r
    r.total = len(r.token_ids)
    content = [_content_tokens(tok, m["content"]) for m in norm]
    # Each message's share with its template wrapping: the growth of the rendered prompt when it is added.
    prev = 0
    for i, m in enumerate(norm):
        try:
            upto = len(tok.apply_chat_template(msgs[:i + 1], False, None))
        except LLMRTError:
            upto = prev  # templates that refuse a partial conversation (e.g. one that must end with a user turn)
        r.messages.append({"role": m["role"], "content_tokens": content[i], "rendered_tokens": upto - prev})
        prev = upto
    tools_tokens = r.total - without_tools if tools else 0
    system = sum(c for c, m in zip(content, norm) if m["role"] == "system")
    last = content[-1] if norm[-1]["role"] != "system" else 0
    history = sum(content) - system - last
    r.parts = {"system": system, "tools": tools_tokens, "history": history, "last_message": last,
               "template": r.total - system - tools_tokens - history - last}
    return r


# ------------------------------------------------------------------------------------------- repeated content
def shared_prefix_tokens(records: list[RequestTokens], block_size: int = 16) -> list[int]:
    """Per request, the prompt tokens the prefix cache could serve: its longest common prefix with any earlier
    request, rounded down to whole KV blocks (the cache keeps only full blocks)."""
    out = []
    for i, r in enumerate(records):
        best = 0
        for other in records[:i]:
            n = 0
            for a, b in zip(r.token_ids, other.token_ids):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        out.append(best // block_size * block_size)
    return out


def repeated_contents(bodies: list[dict[str, Any]], records: list[RequestTokens], tok: Tokenizer,
                      min_tokens: int = MIN_REPEAT_TOKENS) -> list[dict[str, Any]]:
    """Message contents found in two or more requests, each with where it sits: in a shared prefix (the text
    before it is the same in every request that has it: cacheable) or after varying text (flagged requests)."""
    where: dict[str, list[int]] = {}
    for body, rec in zip(bodies, records):
        if rec.error or rec.text is None:
            continue
        seen = set()
        for m in body.get("messages") or []:
            c = m.get("content")
            if isinstance(c, str) and c and c not in seen and c in rec.text:
                seen.add(c)
                where.setdefault(c, []).append(rec.index)
    found = []
    by_index = {r.index: r for r in records}
    for content, idxs in where.items():
        if len(idxs) < 2:
            continue
        n = _content_tokens(tok, content)
        if n < min_tokens:
            continue
        before = {i: by_index[i].text[:by_index[i].text.find(content)] for i in idxs}
        # The cache can serve the content to a request only when an earlier request had the same text before it;
        # the first request computes it anyway. Every other request pays for it again: flagged.
        flagged = [i for k, i in enumerate(idxs) if k and all(before[j] != before[i] for j in idxs[:k])]
        first = before[idxs[0]]
        vary = {i: _content_tokens(tok, before[i][len(_common_prefix([before[i], first])):]) for i in flagged}
        found.append({"content": content[:80] + ("..." if len(content) > 80 else ""), "tokens": n,
                      "requests": len(idxs), "cacheable": not flagged, "flagged_requests": flagged,
                      "varying_tokens_before": vary, "tokens_recomputed": n * len(flagged)})
    return sorted(found, key=lambda f: -f["tokens"] * f["requests"])


def _common_prefix(texts: list[str]) -> str:
    lo, hi = min(texts), max(texts)  # the common prefix of the extremes is everyone's
    n = 0
    while n < len(lo) and lo[n] == hi[n]:
        n += 1
    return lo[:n]


def load_requests(path: str) -> list[dict[str, Any]]:
    """OpenAI request bodies from a JSONL file (one per line; `{"body": {...}}` batch-API lines work too)."""
    out = []
    for k, body in read_jsonl(path, "requests"):
        if isinstance(body, dict) and isinstance(body.get("body"), dict):
            body = body["body"]
        if not isinstance(body, dict) or ("prompt" not in body and "messages" not in body):
            raise InvalidRequestError(f"{path}:{k}: expected a request body with `messages` or `prompt`",
                                      param="requests")
        out.append(body)
    return out
