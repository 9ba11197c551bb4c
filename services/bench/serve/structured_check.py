"""`pagedserve bench structured`: mixed structured-output requests with the official openai client against
a running endpoint, every answer checked.

Kinds, in turn: a json_schema with nested objects, enums, arrays and required fields (strict), a
json_object, a regex, a choice and a Lark grammar with a JSON-schema rule; streaming every other one.
An answer that finished with "stop" must parse and validate (jsonschema, a full regex match, the
choice); one that hit max_tokens is counted apart. Then `chat.completions.parse` with a pydantic model
and a prompt that invites endless whitespace. Needs the `openai` and `jsonschema` packages (test extra).
"""

from __future__ import annotations

import json
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ORDER = {"type": "object", "additionalProperties": False, "required": ["customer", "items", "priority"],
         "properties": {
             "customer": {"type": "object", "additionalProperties": False, "required": ["name", "tier"],
                          "properties": {"name": {"type": "string", "maxLength": 40},
                                         "tier": {"enum": ["free", "pro", "enterprise"]}}},
             "items": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
                 "type": "object", "additionalProperties": False, "required": ["sku", "qty"],
                 "properties": {"sku": {"type": "string", "maxLength": 16},
                                "qty": {"type": "integer", "minimum": 1, "maximum": 99}}}},
             "priority": {"enum": ["low", "normal", "high"]}}}
REGEX = r"[A-Z]{3}-[0-9]{4}"
CHOICES = ["positive", "negative", "neutral"]
GRAMMAR = ('start: "CALL " NAME " " %json {"type": "object", "additionalProperties": false, "required": ["city"], '
           '"properties": {"city": {"type": "string", "maxLength": 30}}}\nNAME: "weather" | "time"')
GRAMMAR_CHECK = re.compile(r"CALL (weather|time) (\{.*\})", re.S)
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


def _request(kind: str, i: int) -> tuple[str, dict]:
    """(endpoint, arguments) of the i-th request of a kind."""
    if kind == "json_schema":
        return "chat", {"messages": [{"role": "user", "content": f"Make up customer order #{i} as JSON."}],
                        "response_format": {"type": "json_schema",
                                            "json_schema": {"name": "order", "schema": ORDER, "strict": True}}}
    if kind == "json_object":
        return "chat", {"messages": [{"role": "user", "content": f"Describe planet number {i} as a JSON object "
                                                                 "with two keys."}],
                        "response_format": {"type": "json_object"}}
    if kind == "regex":
        return "completion", {"prompt": f"Ticket {i} has the id", "extra_body": {"guided_regex": REGEX}}
    if kind == "choice":
        return "chat", {"messages": [{"role": "user", "content": f"Review {i}: 'it broke after a day'. Sentiment?"}],
                        "extra_body": {"guided_choice": CHOICES}}
    return "completion", {"prompt": f"Request {i}: what is the weather in Paris? Tool call:",
                          "extra_body": {"structured_outputs": {"grammar": GRAMMAR}}}


def _valid(kind: str, text: str) -> bool:
    import jsonschema

    try:
        if kind == "json_schema":
            jsonschema.validate(json.loads(text), ORDER)
        elif kind == "json_object":
            return isinstance(json.loads(text), dict)
        elif kind == "regex":
            return re.fullmatch(REGEX, text) is not None
        elif kind == "choice":
            return text in CHOICES
        else:
            m = GRAMMAR_CHECK.fullmatch(text)
            return m is not None and isinstance(json.loads(m.group(2)).get("city"), str)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _one(client, model: str, i: int, max_tokens: int) -> tuple[str, str, str, bool]:
    kind = KINDS[i % len(KINDS)]
    where, args = _request(kind, i)
    stream = i % 2 == 1
    api = client.chat.completions if where == "chat" else client.completions
    resp = api.create(model=model, max_tokens=max_tokens, temperature=0.7 if i % 3 else 0.0, seed=i, stream=stream,
                      **args)
    if stream:
        text, reason = "", None
        for chunk in resp:
            for c in chunk.choices:
                text += (c.delta.content or "") if where == "chat" else c.text
                reason = c.finish_reason or reason
    else:
        c = resp.choices[0]
        text, reason = (c.message.content if where == "chat" else c.text), c.finish_reason
    return kind, text, reason, _valid(kind, text)


def run(args) -> int:
    import openai
    from pydantic import BaseModel, Field

    client = openai.OpenAI(base_url=args.endpoint.rstrip("/") + "/v1", api_key="unused", timeout=600, max_retries=0)
    try:
        model = client.models.list().data[0].id
    except (openai.APIError, IndexError) as exc:  # nothing there, or nothing served
        raise SystemExit(f"pagedserve bench structured: {args.endpoint}/v1/models: {type(exc).__name__}: "
                         f"{exc}") from None
    start = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        results = list(pool.map(lambda i: _one(client, model, i, args.max_tokens), range(args.num_requests)))
    took = time.perf_counter() - start
    print(f"{len(results)} requests ({', '.join(KINDS)}; half streamed) in {took:.0f} s, concurrency "
          f"{args.concurrency}, max_tokens {args.max_tokens}")
    print("| kind | requests | finish stop | valid of stop | finish length |\n|---|---|---|---|---|")
    bad = 0
    for kind in KINDS:
        mine = [r for r in results if r[0] == kind]
        stop = [r for r in mine if r[2] == "stop"]
        valid = sum(r[3] for r in stop)
        bad += len(stop) - valid
        print(f"| {kind} | {len(mine)} | {len(stop)} | {valid} | {sum(r[2] == 'length' for r in mine)} |")
        for r in stop:
            if not r[3]:
                print(f"  INVALID {kind}: {r[1][:200]!r}", file=sys.stderr)

    class Line(BaseModel):
        product: str = Field(max_length=30)
        quantity: int = Field(ge=1, le=10)

    class Invoice(BaseModel):
        number: str = Field(max_length=12)
        lines: list[Line] = Field(min_length=1, max_length=3)
        paid: bool

    parsed = client.chat.completions.parse(model=model, response_format=Invoice, max_tokens=args.max_tokens,
                                           messages=[{"role": "user", "content": "An invoice for two lamps."}])
    obj = parsed.choices[0].message.parsed
    print(f"chat.completions.parse(response_format=Invoice): {type(obj).__name__} {obj!r:.160}")
    # JSON output has no free whitespace (compact separators, by construction), so the trap cannot loop on
    # whitespace: with a schema it must finish; a free json_object may still run on by adding keys (a model's
    # loop, not whitespace), so there the check is that no whitespace beyond the separators appears.
    trap_prompt = [{"role": "user", "content": "Return a JSON object, and put as many spaces, tabs and newlines as "
                                               "you can between every key and value."}]
    person = {"type": "object", "additionalProperties": False, "required": ["name", "city"],
              "properties": {"name": {"type": "string", "maxLength": 30}, "city": {"type": "string", "maxLength": 30}}}
    trap = client.chat.completions.create(
        model=model, max_tokens=args.max_tokens, temperature=0, messages=trap_prompt,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": person, "strict": True}})
    reason = trap.choices[0].finish_reason
    print(f"whitespace trap (json_schema): finish_reason {reason}, {trap.usage.completion_tokens} tokens: "
          f"{trap.choices[0].message.content[:120]!r}")
    free = client.chat.completions.create(model=model, max_tokens=args.max_tokens, temperature=0, messages=trap_prompt,
                                          response_format={"type": "json_object"})
    free_text = free.choices[0].message.content
    stray = _stray_whitespace(free_text)
    print(f"whitespace trap (json_object): finish_reason {free.choices[0].finish_reason}, "
          f"{free.usage.completion_tokens} tokens, whitespace beyond the separators: {stray!r}")
    return 1 if bad or obj is None or reason != "stop" or stray else 0


def _stray_whitespace(text: str) -> list[str]:
    """Whitespace in JSON text other than the single space after ',' and ':' (strings excluded)."""
    out, in_string, escaped = [], False, False
    for i, ch in enumerate(text):
        if in_string:
            escaped, in_string = (not escaped and ch == "\\"), in_string and (escaped or ch != '"')
        elif ch == '"':
            in_string = True
        elif ch.isspace() and not (ch == " " and i > 0 and text[i - 1] in ",:"):
            out.append(text[max(0, i - 10):i + 10])
    return out
