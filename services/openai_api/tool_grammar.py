"""The grammar that holds a request's tool calls to the offered functions and their parameter schemas.

Lark in llguidance's dialect (services.structured_output compiles it), in the call format of
services.openai_api.tool_prompt: each call is `<tool_call>`, a newline, `{"name": "<name>", "arguments":
<object>}` with the object held to the function's `parameters` schema (a `%json` sub-rule, whose
whitespace the compiler bounds), a newline and `</tool_call>`; calls are separated by one newline and
the output ends after the last one.

- required: one call or more; named: exactly one call, to that function;
- auto: free text (a lazy lexeme that ends at the opening tag, so the tag can only begin a call), then
  constrained calls; or free text alone to the end;
- parallel_tool_calls false: exactly one call (and the tag's closing stop string ends generation).
"""

from __future__ import annotations

import json

from services.openai_api.protocol import ChatCompletionRequest
from services.openai_api.tool_prompt import CALL_CLOSE, CALL_OPEN, ToolUse
from services.sampling_params import InvalidRequestError
from services.structured_output.compiler import grammar_text
from services.structured_output.params import StructuredOutputsParams


def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def arguments_schema(parameters: dict) -> dict:
    """A function's parameters as the schema its arguments must match: always an object."""
    return parameters if parameters.get("type") == "object" else {**parameters, "type": "object"}


def tool_constraint(req: ChatCompletionRequest, tools: ToolUse) -> StructuredOutputsParams:
    """The constraint of a request's calls. Each offered function's parameters are checked as a JSON
    schema first, so one that cannot be used is a 400 naming it (`tools.2.function.parameters`) rather
    than the grammar as a whole; raises InvalidRequestError."""
    for i, tool in enumerate(req.tools or ()):
        f = tool.function
        if f.name in tools.names:
            grammar_text(StructuredOutputsParams(json=arguments_schema(f.parameters or {}),
                                                 source=f"tools.{i}.function.parameters"))
    try:
        return StructuredOutputsParams(grammar=tool_grammar(tools), source="tools")
    except InvalidRequestError as exc:
        raise InvalidRequestError("tools", exc.message) from None


def tool_grammar(tools: ToolUse) -> str:
    rules = []
    for i, (name, params) in enumerate(zip(tools.names, tools.schemas, strict=True)):
        head = _lark_string(f'\n{{"name": "{name}", "arguments": ')
        schema = json.dumps(arguments_schema(params), ensure_ascii=False)
        rules.append(f"body_{i}: {head} %json {schema} {_lark_string('}' + chr(10) + CALL_CLOSE)}")
    body = "body: " + " | ".join(f"body_{i}" for i in range(len(tools.names)))
    more = "" if not tools.parallel or tools.choice == "named" else f' ({_lark_string(chr(10) + CALL_OPEN)} body)*'
    if tools.choice == "auto":
        start = [f"start: text body{more} | PLAIN", f"text[stop={_lark_string(CALL_OPEN)}]: /(.|\\n)*/",
                 "PLAIN: /(.|\\n)*/"]
    else:
        start = [f"start: {_lark_string(CALL_OPEN)} body{more}"]
    return "\n".join([*start, body, *rules]) + "\n"
