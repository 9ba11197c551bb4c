"""The request fields that ask for structured output, read into one `StructuredOutputsParams`.

OpenAI's `response_format` (`json_object`, `json_schema` with `strict`), vLLM's `structured_outputs`
(`json`, `regex`, `choice`, `grammar`, `json_object`) and vLLM's older `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar`: at most one of them per request, each error naming the field the
client actually sent. Whether the constraint compiles is the compiler's question, asked by the router
before it routes and by the scheduler before it queues.
"""

from __future__ import annotations

from services.openai_api.errors import APIError
from services.openai_api.protocol import _SamplingFields
from services.request.errors import InvalidRequestError
from services.request.structured_outputs import StructuredOutputsParams

_GUIDED = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
           ("guided_grammar", "grammar"))


def structured_outputs_of(req: _SamplingFields) -> StructuredOutputsParams | None:
    """The request's constraint, or None; raises APIError (400) naming the field at fault."""
    asked = []
    rf = req.response_format
    if rf is not None and rf.type != "text":
        asked.append("response_format")
    if req.structured_outputs is not None:
        asked.append("structured_outputs")
    asked += [name for name, _ in _GUIDED if getattr(req, name) is not None]
    if req.guided_whitespace_pattern is not None and not asked:
        raise APIError(400, "guided_whitespace_pattern: only applies with guided_json or response_format json",
                       "guided_whitespace_pattern")
    if not asked:
        return None
    if len(asked) > 1:
        raise APIError(400, f"{asked[1]}: only one way of constraining the output per request; {asked[0]} is "
                       f"set too", asked[1])
    try:
        return _params(req, asked[0])
    except InvalidRequestError as exc:
        raise APIError.from_invalid(exc) from None


def _params(req: _SamplingFields, which: str) -> StructuredOutputsParams:
    wp = req.guided_whitespace_pattern
    if which == "response_format":
        rf = req.response_format
        if rf.type == "json_object":
            if rf.json_schema is not None:
                raise InvalidRequestError("response_format.json_schema", "only with type json_schema")
            return StructuredOutputsParams(json_object=True, whitespace_pattern=wp, source="response_format")
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise InvalidRequestError("response_format.json_schema.schema",
                                      "type json_schema needs json_schema.schema")
        return StructuredOutputsParams(json=rf.json_schema.schema_, strict=bool(rf.json_schema.strict),
                                       whitespace_pattern=wp, source="response_format.json_schema.schema")
    if which == "structured_outputs":
        so = req.structured_outputs
        set_ = [k for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                               ("grammar", so.grammar), ("json_object", so.json_object)) if v is not None]
        source = f"structured_outputs.{set_[0]}" if len(set_) == 1 else "structured_outputs"
        return StructuredOutputsParams(json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                                       json_object=so.json_object, whitespace_pattern=so.whitespace_pattern or wp,
                                       source=source)
    kind = dict(_GUIDED)[which]
    return StructuredOutputsParams(**{kind: getattr(req, which)}, whitespace_pattern=wp, source=which)
