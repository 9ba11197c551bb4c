"""What a request constrains its output to: `StructuredOutputsParams`, validated on construction.

Exactly one of `json` (a JSON schema), `json_object`, `regex`, `choice` or `grammar` (Lark, in
llguidance's dialect, with `%json {...}` sub-rules) is set, the same fields as vLLM's. Sizes are
bounded here, so nothing a client sends can queue an unbounded compile; whether it compiles at all is
the compiler's question (services.structured_output.compiler). No llguidance, numpy or torch here: the
router, the scheduler and the offline API all build these.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass, field

from services.request.errors import InvalidRequestError

MAX_CONSTRAINT_CHARS = 128 * 1024  # a schema (as JSON), regex or grammar
MAX_CHOICES = 1024
MAX_WHITESPACE_PATTERN_CHARS = 256
KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputsParams:
    json: dict | bool | str | None = None  # a JSON schema, as an object or its JSON text
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark (llguidance's dialect) or GBNF
    json_object: bool | None = None  # any JSON object
    # JSON only: a regex for the whitespace allowed between tokens. None: none at all, with ", " and ": "
    # as separators, so no output can loop on whitespace (the default every JSON request gets).
    whitespace_pattern: str | None = None
    # JSON schema only (OpenAI's strict): an object takes exactly its listed properties unless the schema
    # says otherwise (additionalProperties defaults to false instead of JSON Schema's true).
    strict: bool = False
    # The request field this came from ("response_format.json_schema", "guided_regex", ...): errors name it.
    source: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def kind(self) -> str:
        for name in KINDS:
            value = getattr(self, name)
            if value is not None and value is not False:
                return name
        raise AssertionError("validated params always set one kind")

    @property
    def field_name(self) -> str:
        """The request field to name in an error about this constraint."""
        return self.source or f"structured_outputs.{self.kind}"

    def schema(self) -> dict | bool | None:
        """The JSON schema this constrains to (json and json_object), else None."""
        if self.json_object:
            return {"type": "object"}
        if isinstance(self.json, str):
            return _json.loads(self.json)
        return self.json

    def cache_key(self) -> str:
        """Equal for constraints that compile to the same grammar."""
        value = self.schema() if self.kind in ("json", "json_object") else getattr(self, self.kind)
        return _json.dumps([self.kind, value, self.whitespace_pattern, self.strict], sort_keys=True,
                           separators=(",", ":"))

    def validate(self) -> None:
        def bad(name: str, message: str) -> InvalidRequestError:
            return InvalidRequestError(self.source or f"structured_outputs.{name}", message)

        set_ = [name for name in KINDS if getattr(self, name) is not None and getattr(self, name) is not False]
        if len(set_) != 1:
            where = self.source or "structured_outputs"
            raise InvalidRequestError(where, "exactly one of json, json_object, regex, choice, grammar must be set"
                                      + (f", got {', '.join(set_)}" if set_ else ""))
        kind = set_[0]
        if self.json_object is not None and self.json_object is not True and self.json_object is not False:
            raise bad("json_object", "must be a boolean")
        if kind == "json":
            self._validate_json(bad)
        elif kind in ("regex", "grammar"):
            text = getattr(self, kind)
            if not isinstance(text, str) or not text:
                raise bad(kind, "must be a non-empty string")
            if len(text) > MAX_CONSTRAINT_CHARS:
                raise bad(kind, f"{len(text)} characters; at most {MAX_CONSTRAINT_CHARS}")
        elif kind == "choice":
            c = self.choice
            if not isinstance(c, list) or not c or not all(isinstance(s, str) and s for s in c):
                raise bad("choice", "must be a non-empty list of non-empty strings")
            if len(c) > MAX_CHOICES:
                raise bad("choice", f"{len(c)} choices; at most {MAX_CHOICES}")
            if sum(len(s) for s in c) > MAX_CONSTRAINT_CHARS:
                raise bad("choice", f"more than {MAX_CONSTRAINT_CHARS} characters in all")
        wp = self.whitespace_pattern
        if wp is not None:
            if kind not in ("json", "json_object"):
                raise bad("whitespace_pattern", "applies to json and json_object only")
            if not isinstance(wp, str) or not wp or len(wp) > MAX_WHITESPACE_PATTERN_CHARS:
                raise bad("whitespace_pattern", f"must be a regex of 1 to {MAX_WHITESPACE_PATTERN_CHARS} characters")
        if not isinstance(self.strict, bool):
            raise bad("strict", "must be a boolean")

    def _validate_json(self, bad) -> None:
        value = self.json
        if isinstance(value, str):
            if len(value) > MAX_CONSTRAINT_CHARS:
                raise bad("json", f"{len(value)} characters; at most {MAX_CONSTRAINT_CHARS}")
            try:
                value = _json.loads(value)
            except (ValueError, RecursionError) as exc:
                raise bad("json", f"is not valid JSON: {exc}") from None
        if not isinstance(value, (dict, bool)):
            raise bad("json", f"a JSON schema must be an object or a boolean, got {type(value).__name__}")
        try:
            size = len(_json.dumps(value))
        except (ValueError, TypeError, RecursionError) as exc:
            raise bad("json", f"is not a JSON value: {exc}") from None
        if size > MAX_CONSTRAINT_CHARS:
            raise bad("json", f"{size} characters as JSON; at most {MAX_CONSTRAINT_CHARS}")
