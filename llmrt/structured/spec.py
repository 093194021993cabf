"""StructuredOutputs: what a request's output must match (a JSON schema, any JSON, a regex, an EBNF grammar or
one of a list of strings). Plain data, no xgrammar: it travels to the engine-core process with SamplingParams."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional, Union

from llmrt.errors import InvalidRequestError

KINDS = ("json", "json_object", "regex", "grammar", "choice")


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one constraint; field names as vLLM's `structured_outputs` (`json_object` = any JSON object)."""

    json: Union[None, str, dict[str, Any]] = None  # a JSON schema (object or its text)
    json_object: bool = False
    regex: Optional[str] = None
    grammar: Optional[str] = None  # EBNF (GBNF dialect), root rule `root`
    choice: Optional[tuple[str, ...]] = None
    param: str = "structured_outputs"  # the API field errors about this constraint should name

    def __post_init__(self) -> None:
        if self.choice is not None and not isinstance(self.choice, tuple):
            object.__setattr__(self, "choice", tuple(self.choice))
        self.validate()

    def validate(self) -> None:
        """Raise InvalidRequestError unless exactly one well-typed constraint is set."""
        set_kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise InvalidRequestError(f"{self.param}: give exactly one of {', '.join(KINDS)}"
                                      f"{'' if not set_kinds else f', not {len(set_kinds)}'}", param=self.param)
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise InvalidRequestError(f"{self.param}: json must be a JSON schema object", param=self.param)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"{self.param}: {name} must be a non-empty string", param=self.param)
        if self.choice is not None and (not self.choice or any(not isinstance(c, str) or not c for c in self.choice)):
            raise InvalidRequestError(f"{self.param}: choice must be a non-empty list of non-empty strings",
                                      param=self.param)

    @property
    def kind(self) -> str:
        """Which constraint this is."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def json_schema_text(self) -> Optional[str]:
        """The schema as JSON text (key order kept: it is the order properties are generated in), or None."""
        if self.json is None:
            return None
        if isinstance(self.json, str):
            try:
                return json.dumps(json.loads(self.json))
            except ValueError as e:
                raise InvalidRequestError(f"{self.param}: the JSON schema is not valid JSON: {e}",
                                          param=self.param) from None
        return json.dumps(self.json)

    def key(self) -> tuple[str, str]:
        """(kind, spec text): what a compiled grammar is cached under."""
        kind = self.kind
        if kind == "json":
            return kind, self.json_schema_text or ""
        if kind == "json_object":
            return kind, ""
        if kind == "choice":
            return kind, json.dumps(list(self.choice or ()))
        return kind, getattr(self, kind)

    def ebnf(self) -> Optional[str]:
        """For `choice`: an EBNF grammar whose root is one of the strings; None for other kinds."""
        if self.choice is None:
            return None
        return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice)
