"""Loading HF tokenizers, chat templates, and UTF-8-safe incremental detokenizing."""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from llmrt.errors import InvalidRequestError, ModelLoadError, UnsupportedError
from llmrt.tokenizer_files import RustTokenizerFiles

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ROLES = ("system", "user", "assistant", "tool")
_REPLACEMENT = "\ufffd"
# Tokens of an earlier prompt kept as decoding context, as in vLLM and TGI.
_PROMPT_CONTEXT = 5
# Past this many held-back tokens they are not one character in the making but garbage (say, a logit_bias
# forcing byte tokens): emit them anyway, so that no step ever decodes more than about 2 * _MAX_HELD ids.
_MAX_HELD = 256


class Tokenizer:
    """Wraps a HF tokenizer with the few calls the engine's front end needs."""

    def __init__(self, hf_tokenizer: PreTrainedTokenizerBase | RustTokenizerFiles, chat_template: str | None = None):
        # A transformers tokenizer, or a RustTokenizerFiles that builds one only when `hf` is first read.
        self._base = hf_tokenizer
        self.chat_template: str | dict[str, str] | None = chat_template or hf_tokenizer.chat_template
        self._template_override = chat_template
        self.vocab_size: int = len(hf_tokenizer)
        self.eos_token_id: int | None = hf_tokenizer.eos_token_id
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        # The Rust decoder directly: the transformers wrapper costs twice as much per call, and the
        # detokenizer calls this once or twice per generated token. Cleanup is a Python-side step.
        self._decode: Callable[[list[int], bool], str]
        self.special_ids: frozenset[int]  # what skip_special_tokens drops
        if backend is not None and not hf_tokenizer.clean_up_tokenization_spaces:
            self._decode = backend.decode
            self.special_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        else:
            self._decode = lambda ids, skip: hf_tokenizer.decode(ids, skip_special_tokens=skip)
            self.special_ids = frozenset(hf_tokenizer.all_special_ids)
        # sentencepiece byte-fallback tokens <0x00>..<0xFF>: id -> the byte it stands for (logprobs show it)
        self.byte_values: dict[int, int] = _byte_fallback_values(hf_tokenizer)
        self.byte_token_ids: frozenset[int] = frozenset(self.byte_values)

    @property
    def hf(self) -> PreTrainedTokenizerBase:
        """The transformers tokenizer (imported and built now if this one was read with `tokenizers` alone)."""
        load = getattr(self._base, "load_hf", None)
        return load() if load is not None else self._base

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, with BOS (and whatever else the tokenizer adds) unless told not to."""
        return self._base.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`."""
        return self._decode(ids, skip_special_tokens)

    def encode_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt given as text or as token ids; refuses an empty string."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty", param="prompt")
            return prompt, self.encode(prompt)
        if isinstance(prompt, list):
            return None, list(prompt)
        raise InvalidRequestError(
            f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}", param="prompt")

    def count_tokens(self, text: str) -> int:
        """How many tokens `encode(text)` gives, special tokens included."""
        return len(self.encode(text))

    @property
    def has_chat_template(self) -> bool:
        """Whether `render_chat` can work."""
        return bool(self.chat_template)

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> str:
        """The chat template's text for `messages`."""
        if not self.has_chat_template:
            raise UnsupportedError(
                "this model has no chat template; start the server with a chat template or use the completions API",
                param="messages",
            )
        import jinja2  # here: 0.1-0.5 s of start-up that a completion never needs

        try:
            return self.hf.apply_chat_template(
                normalize_messages(messages),
                tools=tools,
                chat_template=self._template_override,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
            )
        except jinja2.TemplateSyntaxError as e:
            raise ModelLoadError(f"the chat template does not parse: {e}") from e
        except jinja2.TemplateError as e:  # the template's own raise_exception(), e.g. roles that do not alternate
            raise InvalidRequestError(f"the chat template rejected these messages: {e}", param="messages") from e

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> list[int]:
        """Token ids of the rendered chat; no special tokens are added, since templates write BOS themselves."""
        return self.encode(self.render_chat(messages, add_generation_prompt, tools), add_special_tokens=False)


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Checks OpenAI-style messages and returns copies whose content is one string."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list", param="messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequestError(f"messages[{i}] must be an object", param="messages")
        role = message.get("role")
        if role not in ROLES:
            raise InvalidRequestError(
                f"messages[{i}].role must be one of {', '.join(ROLES)}, not {role!r}", param="messages"
            )
        out.append({**message, "content": _content_text(message, i)})
    return out


def _content_text(message: dict[str, Any], i: int) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if content is None and message["role"] == "assistant" and message.get("tool_calls"):
        return ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise InvalidRequestError(
                    f"messages[{i}].content parts must be {{\"type\": \"text\", \"text\": <string>}}", param="messages"
                )
            texts.append(part["text"])
        return "\n".join(texts)  # as vLLM joins text parts
    raise InvalidRequestError(
        f"messages[{i}].content must be a string or a list of text parts, not {type(content).__name__}",
        param="messages",
    )


def _byte_fallback_values(hf: PreTrainedTokenizerBase | RustTokenizerFiles) -> dict[int, int]:
    """Id -> byte of the sentencepiece byte-fallback tokens <0x00>..<0xFF>; empty when the vocab lacks any."""
    pieces = [f"<0x{b:02X}>" for b in range(256)]
    ids = hf.convert_tokens_to_ids(pieces)
    if any(i is None or i == hf.unk_token_id for i in ids) or hf.convert_ids_to_tokens(ids) != pieces:
        return {}
    return {i: b for b, i in enumerate(ids)}


def load_tokenizer(path: str, chat_template: str | None = None) -> Tokenizer:
    """Loads the tokenizer of a local HF model dir; `chat_template` (a template or a file) overrides the model's."""
    if str(path).endswith(".gguf") and os.path.isfile(path):
        from llmrt.model.gguf_file import gguf_tokenizer

        return Tokenizer(gguf_tokenizer(path), _read_chat_template(chat_template))
    if not os.path.isdir(path):
        raise ModelLoadError(f"tokenizer path {path!r} is not a directory")
    template = _read_chat_template(chat_template)
    fast = RustTokenizerFiles.open(path)
    if fast is not None:
        return Tokenizer(fast, template)
    # Imported here: transformers brings in torch, seconds that `import llmrt.tokenizer` need not pay.
    from transformers import AutoTokenizer, GPT2Tokenizer

    try:
        hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:
        # A bare GPT-2-style vocab.json + merges.txt has no config naming its class.
        if not all(os.path.isfile(os.path.join(path, f)) for f in ("vocab.json", "merges.txt")):
            raise ModelLoadError(f"no usable tokenizer in {path}: {type(e).__name__}: {e}") from e
        try:
            hf = GPT2Tokenizer.from_pretrained(path, local_files_only=True)
        except Exception as e2:
            raise ModelLoadError(f"no usable tokenizer in {path}: {type(e2).__name__}: {e2}") from e2
    if len(hf) == 0:
        raise ModelLoadError(f"the tokenizer in {path} has an empty vocabulary")
    return Tokenizer(hf, template)


def _read_chat_template(template: str | None) -> str | None:
    if template is None:
        return None
    if os.path.isfile(template):
        with open(template, encoding="utf-8") as f:
            return f.read()
    if "{" not in template:
        raise ModelLoadError(f"chat template {template!r} is neither a file nor a Jinja template")
    return template


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas that never contain broken UTF-8."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self._deltas: list[str] = []  # joined on read: `+=` on an attribute would copy all the text each step
        self._skip = tokenizer.special_ids if skip_special_tokens else frozenset()
        self._bytes = tokenizer.byte_token_ids
        # The last few decodable ids (the vLLM/TGI prefix_offset/read_offset scheme): the first _read of
        # them decode to _prefix, text already accounted for; each step decodes the window and emits
        # what it adds to _prefix. Skipped special tokens never enter it: the decoder drops them anyway.
        tail = prompt_token_ids[-(_MAX_HELD + _PROMPT_CONTEXT):]
        window = [i for i in tail if i not in self._skip]
        run = len(window)  # a byte run still open at the prompt's end decodes as one unit with what follows
        while run > 0 and window[run - 1] in self._bytes:
            run -= 1
        self._window = window[min(max(len(window) - _PROMPT_CONTEXT, 0), run):]
        self._read = len(self._window)
        self._prefix = tokenizer.decode(self._window, skip_special_tokens)

    @property
    def output_text(self) -> str:
        """All text emitted so far."""
        if len(self._deltas) > 1:
            self._deltas = ["".join(self._deltas)]
        return self._deltas[0] if self._deltas else ""

    def step(self, new_token_ids: list[int]) -> str:
        """Appends `new_token_ids` and returns the text they complete (possibly "")."""
        self.token_ids.extend(new_token_ids)
        self._window.extend(i for i in new_token_ids if i not in self._skip)
        held = len(self._window) - self._read
        if held == 0:
            return ""
        text = self.tokenizer.decode(self._window, self.skip_special_tokens)
        unfinished = text.endswith(_REPLACEMENT)  # a multi-byte character may still be arriving
        if held < _MAX_HELD:
            # The byte-fallback decoder turns a whole run of byte tokens into U+FFFDs if any byte in it is
            # invalid, so a run's text is final only once a non-byte token closes the run.
            if unfinished or len(text) <= len(self._prefix) or self._window[-1] in self._bytes:
                return ""
        elif unfinished and held < 2 * _MAX_HELD:
            return ""
        return self._emit(text)

    def flush(self) -> str:
        """Emits whatever is held back (an unfinished character as U+FFFD); call it when the stream ends."""
        if len(self._window) == self._read:
            return ""
        return self._emit(self.tokenizer.decode(self._window, self.skip_special_tokens))

    def _emit(self, text: str) -> str:
        delta = text[len(self._prefix):]
        if self._window[-1] in self._bytes:
            # Cut out of a byte run still open (only at _MAX_HELD or flush): its rest starts afresh at this
            # character boundary, after the last other tokens, which keep their part as context.
            self._window = [i for i in self._window if i not in self._bytes][-_PROMPT_CONTEXT:]
        else:
            # The last tokens just emitted are the next step's context; every byte run in them is closed.
            self._window = self._window[max(self._read, len(self._window) - _PROMPT_CONTEXT):]
        self._read = len(self._window)
        self._prefix = self.tokenizer.decode(self._window, self.skip_special_tokens)
        if delta:
            self._deltas.append(delta)
        return delta
