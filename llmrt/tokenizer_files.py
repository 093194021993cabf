"""A tokenizer read straight from tokenizer.json with the Rust `tokenizers` library, without transformers.

Importing transformers and building its tokenizer costs seconds; the first token of `llmrt generate` needs
only encode and decode. `RustTokenizerFiles` answers the calls llmrt's `Tokenizer` makes, and loads the
transformers tokenizer only when something needs it (chat templates, xgrammar).
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional

# Classes whose transformers tokenizer is tokenizer.json as written, checked token for token against
# transformers in tests/test_cold_start.py. Others (sentencepiece models, classes that rebuild their
# pre-tokenizer from config flags) keep the transformers path.
_PLAIN_CLASSES = frozenset({"PreTrainedTokenizerFast", "GPT2Tokenizer", "GPT2TokenizerFast",
                            "TokenizersBackend"})


def _token_text(value: Any) -> Optional[str]:
    """A special token entry of tokenizer_config.json: a string, or an AddedToken dict with "content"."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class RustTokenizerFiles:
    """The subset of a transformers fast tokenizer that llmrt's Tokenizer uses, over a `tokenizers.Tokenizer`."""

    clean_up_tokenization_spaces = False

    def __init__(self, path: str, backend: Any, config: dict[str, Any], chat_template: Optional[str]):
        self.path = path
        self.backend_tokenizer = backend
        self.chat_template = chat_template
        self.bos_token_id = self._id_of(config.get("bos_token"))
        self.eos_token_id = self._id_of(config.get("eos_token"))
        self.unk_token_id = self._id_of(config.get("unk_token"))
        self._hf: Any = None

    @classmethod
    def open(cls, path: str) -> Optional["RustTokenizerFiles"]:
        """The Rust tokenizer of model dir `path`, or None when only transformers would load it faithfully."""
        tok_file, cfg_file = os.path.join(path, "tokenizer.json"), os.path.join(path, "tokenizer_config.json")
        if not (os.path.isfile(tok_file) and os.path.isfile(cfg_file)):
            return None
        with open(cfg_file, encoding="utf-8") as f:
            config = json.load(f)
        if config.get("tokenizer_class") not in _PLAIN_CLASSES or config.get("clean_up_tokenization_spaces", False) \
                or config.get("split_special_tokens", False) or config.get("add_prefix_space") is not None:
            return None  # transformers would post-process decodes, or rewrite the pre-tokenizer
        from tokenizers import Tokenizer as RustTokenizer

        template = config.get("chat_template")
        jinja = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.isfile(jinja):
            with open(jinja, encoding="utf-8") as f:
                template = f.read()
        if not isinstance(template, (str, type(None))):
            return None  # a list of named templates: transformers picks among them
        tok = cls(path, RustTokenizer.from_file(tok_file), config, template)
        return tok if tok._adds_what_config_says(config) and tok._has_added_tokens(config) else None

    def _id_of(self, token: Any) -> Optional[int]:
        text = _token_text(token)
        return None if text is None else self.backend_tokenizer.token_to_id(text)

    def _adds_what_config_says(self, config: dict[str, Any]) -> bool:
        """transformers adds BOS/EOS by add_bos_token/add_eos_token; the file's post-processor must agree."""
        ids = self.backend_tokenizer.encode("a", add_special_tokens=True).ids
        for flag, token_id, at in (("add_bos_token", self.bos_token_id, 0), ("add_eos_token", self.eos_token_id, -1)):
            if flag in config and token_id is not None and bool(config[flag]) != (bool(ids) and ids[at] == token_id):
                return False
        return True

    def _has_added_tokens(self, config: dict[str, Any]) -> bool:
        """transformers adds the config's added_tokens_decoder entries; the file must hold them already."""
        for key, entry in (config.get("added_tokens_decoder") or {}).items():
            if self.backend_tokenizer.token_to_id(_token_text(entry) or "") != int(key):
                return False
        return True

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of the added tokens marked special."""
        return [i for i, t in self.backend_tokenizer.get_added_tokens_decoder().items() if t.special]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`."""
        # encode_batch releases the GIL while it works and encode does not (tokenizers 0.23: a 512 KB prompt held
        # it for ~170 ms, and the server's event loop with it, although the call runs on the offload pool); the
        # same ids, ~1 us more for a short text
        return self.backend_tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`."""
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_ids(self, tokens: Any) -> Any:
        """Id of a token string (or a list of them); the unknown token's id where absent."""
        if isinstance(tokens, str):
            found = self.backend_tokenizer.token_to_id(tokens)
            return self.unk_token_id if found is None else found
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_ids_to_tokens(self, ids: Any) -> Any:
        """Token string of an id (or a list of them)."""
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(i) for i in ids]

    def load_hf(self) -> Any:
        """The transformers tokenizer of the same directory (imported and built on first call)."""
        if self._hf is None:
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        return self._hf
