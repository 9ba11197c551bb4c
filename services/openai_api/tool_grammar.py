"""The grammar that holds a request's tool calls to the offered functions and their parameter schemas.

Lark in llguidance's dialect (services.structured_output compiles it), in the call format of
services.openai_api.tool_prompt: each call is `<tool_call>`, a newline, `{"name": "<name>", "arguments":
<object>}` with the object held to the function's `parameters` schema (a `%json` sub-rule, whose
whitespace the compiler bounds), a newline and `</tool_call>`; calls are separated by one newline and
the output ends after the last one.

- required: one call or more (at most MAX_CALLS: a model that would call on and on, as a weak one
  under a grammar may, ends there instead of at max_tokens); named: exactly one call, to that function;
- auto: free text (a lazy lexeme that ends at the opening tag, so the tag can only begin a call), then
  constrained calls; or free text alone to the end;
- parallel_tool_calls false: exactly one call (and the tag's closing stop string ends generation).
"""

from __future__ import annotations

import json

from services.openai_api.errors import APIError
from services.openai_api.tool_prompt import CALL_CLOSE, CALL_OPEN, ToolUse
from services.request.errors import InvalidRequestError
from services.request.structured_outputs import StructuredOutputsParams

MAX_CALLS = 8  # calls in one answer; the next turn may call again


def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def arguments_schema(parameters: dict) -> dict:
    """A function's parameters as the schema its arguments must match: always an object."""
    return parameters if parameters.get("type") == "object" else {**parameters, "type": "object"}


def tool_constraint(tools: ToolUse) -> StructuredOutputsParams:
    """The constraint of a request's calls (raises InvalidRequestError naming `tools`)."""
    return StructuredOutputsParams(grammar=tool_grammar(tools), source="tools")


async def compile_constraint(grammars, params: StructuredOutputsParams, tools: ToolUse | None) -> None:
    """Compile a request's constraint with `grammars` (a GrammarCompiler), or raise a 400. When the tools'
    grammar fails, the function whose parameters fail alone is named (`tools.2.function.parameters`)."""
    try:
        await grammars.compile_async(params)
    except InvalidRequestError as exc:
        if tools is not None and exc.field == "tools":
            for schema, field in zip(tools.schemas, tools.fields, strict=True):
                try:
                    await grammars.compile_async(StructuredOutputsParams(json=arguments_schema(schema), source=field))
                except InvalidRequestError as culprit:
                    raise APIError.from_invalid(culprit) from None
        raise APIError.from_invalid(exc) from None


def tool_grammar(tools: ToolUse) -> str:
    rules = []
    for i, (name, params) in enumerate(zip(tools.names, tools.schemas, strict=True)):
        head = _lark_string(f'\n{{"name": "{name}", "arguments": ')
        schema = json.dumps(arguments_schema(params), ensure_ascii=False)
        rules.append(f"body_{i}: {head} %json {schema} {_lark_string('}' + chr(10) + CALL_CLOSE)}")
    body = "body: " + " | ".join(f"body_{i}" for i in range(len(tools.names)))
    more = "" if not tools.parallel or tools.choice == "named" else (
        f' ({_lark_string(chr(10) + CALL_OPEN)} body){{0,{MAX_CALLS - 1}}}')
    if tools.choice == "auto":
        start = [f"start: text body{more} | PLAIN", f"text[stop={_lark_string(CALL_OPEN)}]: /(.|\\n)*/",
                 "PLAIN: /(.|\\n)*/"]
    else:
        start = [f"start: {_lark_string(CALL_OPEN)} body{more}"]
    return "\n".join([*start, body, *rules]) + "\n"
