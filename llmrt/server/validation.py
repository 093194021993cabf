"""The front door: checks every request passes before any of its text or token ids reaches a tokenizer, a chat
template, a grammar or the engine.

Policy on lone UTF-16 surrogates (JSON escapes \\ud800-\\udfff not part of a pair): refused with 400
invalid_request whose `param` names the field (`messages[0].content`, `prompt[1]`, `tools[0].function.name`),
wherever they are in the body: they are not characters, and no tokenizer, template or grammar can take them.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from pydantic import BaseModel

from llmrt.errors import ContextLengthExceededError, InvalidRequestError


def reject_lone_surrogates(body: BaseModel) -> None:
    """400 invalid_request naming the field if any string (or object key) in `body` holds a lone surrogate."""
    where = _find_surrogate(body, "")
    if where is not None:
        raise InvalidRequestError(f"{where or 'the body'}: holds a lone UTF-16 surrogate (an unpaired "
                                  "\\ud800-\\udfff escape), which is not a character; send valid Unicode",
                                  param=where or None)


def _find_surrogate(value: Any, path: str) -> Optional[str]:
    if isinstance(value, str):
        return path if _has_surrogate(value) else None
    if isinstance(value, BaseModel):
        items = [(field.alias or name, getattr(value, name)) for name, field in type(value).model_fields.items()]
        items += list((value.model_extra or {}).items())  # extras kept by the model reach the chat template
        return _find_in_items(items, path)
    if isinstance(value, dict):
        return _find_in_items(list(value.items()), path)
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found = _find_surrogate(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def _find_in_items(items: list[tuple[Any, Any]], path: str) -> Optional[str]:
    for key, item in items:
        if isinstance(key, str) and _has_surrogate(key):
            return path  # the key itself: name the object that holds it
        found = _find_surrogate(item, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")  # C speed; fails exactly on surrogates
    except UnicodeEncodeError:
        return True
    return False


def check_token_ids(ids: Sequence[Any], vocab_size: int, max_model_len: Optional[int], where: str,
                    param: str) -> list[int]:
    """A token-id prompt as a list of ints in [0, vocab_size), shorter than max_model_len (if given).

    `where` is the field path in messages (`prompt[2]`), `param` the field the error names.
    """
    if not ids:
        raise InvalidRequestError(f"{where}: must not be empty", param=param)
    for k, t in enumerate(ids):
        if not isinstance(t, int) or isinstance(t, bool):
            raise InvalidRequestError(f"{where}[{k}]: token ids must be integers, got {type(t).__name__}",
                                      param=param)
        if not 0 <= t < vocab_size:
            raise InvalidRequestError(f"{where}[{k}]: token id {t} is out of the vocabulary [0, {vocab_size})",
                                      param=param)
    if max_model_len is not None and len(ids) >= max_model_len:
        raise ContextLengthExceededError(
            f"{where}: this model's maximum context length is {max_model_len} tokens, but the prompt alone has "
            f"{len(ids)}; shorten the prompt", param=param)
    return list(ids)


def check_request_tokens(count: int, limit: int, param: str) -> None:
    """400 invalid_request if one request carries more than `limit` prompt tokens (--max-request-tokens)."""
    if count > limit:
        raise InvalidRequestError(f"{param}: the request holds {count} prompt tokens, over this server's limit of "
                                  f"{limit} per request (--max-request-tokens)", param=param)
