"""The router's prepared request, as it travels to a replica on the internal hop.

The router parses a client's body, applies the chat template, tokenizes, builds the tool grammar and
validates every sampling field before it routes. Forwarding the raw body made the replica do all of it
again. Instead the router sends what it prepared: prompt token ids, the sampling parameters as
`SamplingParams` holds them (stop strings including the tool-call stop, the constraint including the tool
grammar, the per-key cache salt), the tools the output is parsed for, and the echo texts. The replica
takes it only from a caller that holds the internal token (the signed hop), and re-checks it with the
same rules as every other boundary (`SamplingParams` re-validates itself, prompts are checked against
the vocabulary and the context length), so a wrong router cannot make it serve something it would refuse.

Version 1, a JSON object (the body of the same `POST /v1/completions` or `/v1/chat/completions`), marked by
the header `x-pagedserve-prepared: 1`:

    {"v": 1, "kind": "chat" | "completion", "model": str, "prompts": [[int, ...], ...],
     "params": {<SamplingParams init fields>, "stop": [str], "derived_stop": [] | [<the tool-call stop>],
                "logit_bias": [[id, bias], ...] | null,
                "structured_outputs": {<StructuredOutputsParams fields>} | null},
     "stream": bool, "include_usage": bool,
     "tools": {"choice", "names", "parallel", "schemas", "fields"} | null, "echo": [str] | null}

A request reaching a replica directly (`serve`'s public port goes through its router; the offline API
never uses HTTP) still gets the full checks of `services.openai_api.prompts`.
"""

from __future__ import annotations

import dataclasses
import json

from services.openai_api.errors import APIError
from services.openai_api.prompts import PreparedRequest, check_context_length
from services.openai_api.tool_prompt import CALL_CLOSE, ToolUse
from services.request.errors import InvalidRequestError
from services.request.limits import check_vocabulary
from services.request.sampling_params import SamplingParams
from services.request.structured_outputs import StructuredOutputsParams

HEADER = "x-pagedserve-prepared"
VERSION = 1
_KINDS = ("chat", "completion")
# SamplingParams fields sent as they are (stop, logit_bias and structured_outputs have their own forms).
_PLAIN = tuple(f.name for f in dataclasses.fields(SamplingParams)
               if f.init and f.name not in ("stop", "logit_bias", "structured_outputs"))
_SO_FIELDS = tuple(f.name for f in dataclasses.fields(StructuredOutputsParams) if f.init)


def to_wire(prepared: PreparedRequest) -> bytes:
    p = prepared.params
    params = {name: getattr(p, name) for name in _PLAIN}
    params["stop"] = p.stop  # None or the client's list (a string became a list when params were built)
    # What `prepare` appended after validation (the tool-call stop), beyond the client's own limit.
    params["derived_stop"] = p.stop_strings[len(p.stop or []):]
    params["logit_bias"] = [[t, b] for t, b in p.logit_bias.items()] if p.logit_bias else None
    so = p.structured_outputs
    params["structured_outputs"] = {name: getattr(so, name) for name in _SO_FIELDS} if so is not None else None
    tools = dataclasses.asdict(prepared.tools) if prepared.tools is not None else None
    return json.dumps({"v": VERSION, "kind": prepared.kind, "model": prepared.model, "prompts": prepared.prompts,
                       "params": params, "stream": prepared.stream, "include_usage": prepared.include_usage,
                       "tools": tools, "echo": prepared.echo}).encode()


def from_wire(body: dict, vocab_size: int, max_model_len: int, kind: str) -> PreparedRequest:
    """The prepared request, re-checked with the rules every boundary applies; a 400 naming the field
    otherwise (a router of another version, or a bug: never silently served differently)."""
    if body.get("v") != VERSION:
        raise APIError(400, f"prepared request version {body.get('v')!r} is not {VERSION}", HEADER)
    if body.get("kind") != kind:
        raise APIError(400, f"a prepared {body.get('kind')!r} request was sent to the {kind} endpoint", "kind")
    try:
        prompts = body["prompts"]
        if (not isinstance(prompts, list) or not prompts
                or not all(isinstance(p, list) and p and all(type(t) is int and t >= 0 for t in p) for p in prompts)):
            raise InvalidRequestError("prompt", "must be non-empty lists of token ids")
        if max(max(p) for p in prompts) >= vocab_size:
            raise InvalidRequestError("prompt", f"a token id is outside the vocabulary [0, {vocab_size})")
        params = _params(body["params"])
        check_vocabulary(vocab_size, params.top_k, params.stop_token_ids, params.logit_bias)
        tools = body.get("tools")
        tools = ToolUse(tools["choice"], tuple(tools["names"]), bool(tools["parallel"]),
                        tuple(tools["schemas"]), tuple(tools.get("fields", ()))) if tools is not None else None
        echo = body.get("echo")
        if echo is not None and (not isinstance(echo, list) or not all(isinstance(e, str) for e in echo)):
            raise InvalidRequestError("echo", "must be the prompts' texts")
        prepared = PreparedRequest(kind, str(body["model"]), prompts, params, bool(body["stream"]),
                                   bool(body["include_usage"]), tools, echo)
    except InvalidRequestError as exc:
        raise APIError.from_invalid(exc) from None
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise APIError(400, f"malformed prepared request: {type(exc).__name__}: {exc}"[:300], HEADER) from None
    check_context_length(max(len(p) for p in prompts), params.max_tokens, max_model_len,
                         "messages" if kind == "chat" else "prompt", "max_tokens")
    return prepared


def _params(fields: dict) -> SamplingParams:
    kwargs = {name: fields[name] for name in _PLAIN if name in fields}
    kwargs["stop"] = fields.get("stop")
    bias = fields.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, list) or not all(isinstance(e, list) and len(e) == 2 for e in bias):
            raise InvalidRequestError("logit_bias", "must be [token id, bias] pairs")
        kwargs["logit_bias"] = {t: b for t, b in bias}
    so = fields.get("structured_outputs")
    if so is not None:
        kwargs["structured_outputs"] = StructuredOutputsParams(**{k: so[k] for k in _SO_FIELDS if k in so})
    params = SamplingParams(**kwargs)
    derived = fields.get("derived_stop") or []
    if derived not in ([], [CALL_CLOSE]):
        raise InvalidRequestError("stop", f"the only stop a router derives is the tool call's {CALL_CLOSE!r}")
    params.stop_strings += derived
    return params
