"""Tools in the prompt: function definitions, earlier calls and their results, rendered for the model.

Calls are written in the Hermes/Qwen format, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
the one most open models are trained on. A chat template that reads `tools` and writes that tag renders
everything itself, given what transformers gives it (`tools=`, assistant `tool_calls` with arguments as
objects, `tool` messages). Any other template (the bundled SmolLM2's has no tools block) gets the
fallback, which needs nothing from the template: the functions in a system block (`FALLBACK_INSTRUCTIONS`),
earlier calls as `<tool_call>` blocks in the assistant's text, and results as `<tool_response>` blocks in
a user turn (consecutive results in one turn), as Qwen's own template renders them.

Router and replica both run this (services.openai_api.prompts), so both refuse the same requests: a
`tool` message whose `tool_call_id` answers no earlier call, `tool_choice` naming a missing function,
duplicate names, parameter schemas that are not objects.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from services.openai_api.errors import APIError
from services.openai_api.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"

FALLBACK_INSTRUCTIONS = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass(frozen=True)
class ToolUse:
    """What a request lets the model call, which the replica needs to read calls out of its output."""

    choice: str  # "auto", "required" or "named"
    names: tuple[str, ...]  # the functions it may call (only the named one under a named choice)
    parallel: bool  # false: exactly one call, then generation ends
    schemas: tuple[dict, ...]  # each name's parameter schema ({} when the tool gave none)
    fields: tuple[str, ...] = ()  # the request field of each schema, for errors


def tool_use(req: ChatCompletionRequest) -> ToolUse | None:
    """The calls this request allows; None when it allows none (no tools, or tool_choice "none").
    Raises APIError (400) for tools, a tool_choice or a history of calls that cannot be served."""
    check_tools(req)
    _check_history(req.messages)
    if not req.tools or req.tool_choice == "none":
        return None
    tools = [(i, t.function) for i, t in enumerate(req.tools)]
    choice = req.tool_choice or "auto"
    if isinstance(choice, NamedToolChoice):
        tools = [(i, f) for i, f in tools if f.name == choice.function.name]
        choice = "named"
    return ToolUse(choice, tuple(f.name for _, f in tools), req.parallel_tool_calls is not False,
                   tuple(f.parameters or {} for _, f in tools),
                   tuple(f"tools.{i}.function.parameters" for i, _ in tools))


def check_tools(req: ChatCompletionRequest) -> None:
    names: set[str] = set()
    for i, tool in enumerate(req.tools or ()):
        f = tool.function
        if f.name in names:
            raise APIError(400, f"tools.{i}.function.name: {f.name!r} is defined twice", f"tools.{i}.function.name")
        names.add(f.name)
        params = f.parameters
        if params is not None and params.get("type", "object") != "object":
            field = f"tools.{i}.function.parameters"
            raise APIError(400, f"{field}: a function's parameters must be a JSON schema of type \"object\", "
                           f"got type {params.get('type')!r}", field)
    choice = req.tool_choice
    if choice in ("required",) or isinstance(choice, NamedToolChoice):
        if not req.tools:
            raise APIError(400, "tool_choice: forcing a tool call needs tools", "tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise APIError(400, f"tool_choice: no tool named {choice.function.name!r} among tools",
                       "tool_choice.function.name")


def native(tokenizer) -> bool:
    """Whether the model's own template renders tools in the format the parser reads."""
    return bool(getattr(tokenizer, "template_reads_tools", False)) and CALL_OPEN in getattr(
        tokenizer, "template_source", "")


def template_messages(req: ChatCompletionRequest, tokenizer) -> tuple[list[dict], list[dict] | None]:
    """The conversation as chat-template dicts, and the tools to pass the template (None: it is not given
    any, because none are offered or the fallback already wrote them into the messages)."""
    offered = req.tools if req.tools and req.tool_choice != "none" else None
    defs = [t.model_dump(exclude_none=True) for t in offered] if offered else None
    if native(tokenizer):
        return [_native_message(m) for m in req.messages], defs
    messages = _fallback_messages(req.messages)
    if defs:
        block = FALLBACK_INSTRUCTIONS.format(tools="\n".join(json.dumps(d, ensure_ascii=False) for d in defs))
        if messages and messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + block}
        else:
            messages.insert(0, {"role": "system", "content": block})
    return messages, None


def _check_history(messages: list[ChatMessage]) -> None:
    called: set[str] = set()
    for i, m in enumerate(messages):
        if m.tool_calls and m.role != "assistant":
            raise APIError(400, f"messages.{i}.tool_calls: only assistant messages make tool calls",
                           f"messages.{i}.tool_calls")
        if m.tool_call_id is not None and m.role != "tool":
            raise APIError(400, f"messages.{i}.tool_call_id: only tool messages answer a tool call",
                           f"messages.{i}.tool_call_id")
        called.update(c.id for c in m.tool_calls or ())
        if m.role == "tool":
            if m.tool_call_id is None:
                raise APIError(400, f"messages.{i}.tool_call_id: a tool message must name the call it answers",
                               f"messages.{i}.tool_call_id")
            if m.tool_call_id not in called:
                raise APIError(400, f"messages.{i}.tool_call_id: {m.tool_call_id!r} answers no tool call of an "
                               "earlier assistant message", f"messages.{i}.tool_call_id")


def _arguments_value(arguments: str):
    """Arguments as an object where they parse (templates write them with tojson), else the text."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _native_message(m: ChatMessage) -> dict:
    d = m.as_template_dict()
    if m.tool_calls:
        d["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.function.name, "arguments": _arguments_value(c.function.arguments)}} for c in m.tool_calls]
    if m.role == "tool":
        d["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        d["name"] = m.name
    return d


def render_call(name: str, arguments: str) -> str:
    """One call as the model writes it (and as the grammar of services.openai_api.tool_grammar forces it)."""
    value = _arguments_value(arguments)
    args = arguments if isinstance(value, dict) else json.dumps(value, ensure_ascii=False)
    return f'{CALL_OPEN}\n{{"name": "{name}", "arguments": {args}}}\n{CALL_CLOSE}'


def _fallback_messages(messages: list[ChatMessage]) -> list[dict]:
    out: list[dict] = []
    for m in messages:
        if m.role == "tool":
            result = f"{RESPONSE_OPEN}\n{m.text}\n{RESPONSE_CLOSE}"
            if out and out[-1].get("_results"):
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result, "_results": True})
            continue
        d = m.as_template_dict()
        if m.tool_calls:
            calls = "\n".join(render_call(c.function.name, c.function.arguments) for c in m.tool_calls)
            d["content"] = (d["content"] + "\n" if d["content"] else "") + calls
        out.append(d)
    for d in out:
        d.pop("_results", None)
    return out
