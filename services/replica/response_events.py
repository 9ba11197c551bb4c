"""The Responses API's objects: typed stream events and the final `response`, from chat deltas.

A response is generated as a chat completion with one choice (services.openai_api.responses_protocol),
so its output arrives as the chat stream's deltas: content, and tool-call pieces (services.replica
.accumulator). Those become output items (a `message` with one `output_text` part, or a
`function_call`), opened with `output_item.added`, grown by `output_text.delta` or
`function_call_arguments.delta`, closed with their `.done` events, in the order the official client's
`responses.stream` accumulates them. The non-streamed response is built by the same code from the same
deltas, so the two agree by construction.
"""

from __future__ import annotations

import json
import uuid

from services.openai_api.errors import APIError
from services.openai_api.responses_protocol import ResponsesRequest


def _sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: " + json.dumps(event, separators=(",", ":"), ensure_ascii=False) + "\n\n"


class ResponseEvents:
    """One response: fed the chat stream choices of its single choice; renders events and the object."""

    def __init__(self, req: ResponsesRequest, response_id: str, created: int, usage):
        self.req = req
        self.id = response_id
        self.created = created
        self.usage = usage  # () -> the chat usage dict, read when the response completes
        self.items: list[dict] = []
        self._open: dict | None = None  # the item being written
        self._seq = 0
        self.finish_reason: str | None = None

    # -- the stream format of services.replica.openai_serving ----------------------------------------------
    def opening(self) -> list[str]:
        snapshot = self.snapshot("in_progress")
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def chunks(self, choices: list[dict]) -> list[str]:
        out: list[str] = []
        for ch in choices:
            delta = ch.get("delta", {})
            if delta.get("content"):
                out += self._text(delta["content"])
            for call in delta.get("tool_calls") or ():
                out += self._call(call)
            if ch.get("finish_reason") is not None:
                self.finish_reason = ch["finish_reason"]
        return out

    def absorb(self, choices: list[dict]) -> None:
        self.chunks(choices)

    def closing(self) -> list[str]:
        out = self._close()
        if not self.items:  # nothing generated: an empty message, as OpenAI answers
            out += self._text("") + self._close()
        status = "incomplete" if self.finish_reason == "length" else "completed"
        out.append(self._event(f"response.{status}", response=self.snapshot(status)))
        return out

    def failed(self, err: APIError) -> list[str]:
        return [self._event("error", code=err.code or "server_error", message=err.message, param=err.param),
                self._event("response.failed", response={**self.snapshot("failed"), "error": {
                    "code": "server_error", "message": err.message}})]

    def whole(self) -> dict:
        """The non-streamed response: the object the stream's last event carries."""
        self.closing()
        return self.snapshot("incomplete" if self.finish_reason == "length" else "completed")

    # -- output items ---------------------------------------------------------------------------
    def _text(self, text: str) -> list[str]:
        out: list[str] = []
        if self._open is None or self._open["type"] != "message":
            out += self._close()
            item = {"id": "msg_" + uuid.uuid4().hex, "type": "message", "status": "in_progress",
                    "role": "assistant", "content": []}
            out += self._add(item)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["content"].append(part)
            out.append(self._event("response.content_part.added", item_id=item["id"], output_index=self._index(),
                                   content_index=0, part=dict(part)))
        part = self._open["content"][0]
        part["text"] += text
        if text:
            out.append(self._event("response.output_text.delta", item_id=self._open["id"],
                                   output_index=self._index(), content_index=0, delta=text, logprobs=[]))
        return out

    def _call(self, call: dict) -> list[str]:
        out: list[str] = []
        fragment = call.get("function", {}).get("arguments", "")
        if call.get("id") is not None:
            out += self._close()
            item = {"id": "fc_" + uuid.uuid4().hex, "type": "function_call", "status": "in_progress",
                    "call_id": call["id"], "name": call["function"]["name"], "arguments": ""}
            out += self._add(item)
        if fragment and self._open is not None and self._open["type"] == "function_call":
            self._open["arguments"] += fragment
            out.append(self._event("response.function_call_arguments.delta", item_id=self._open["id"],
                                   output_index=self._index(), delta=fragment))
        return out

    def _add(self, item: dict) -> list[str]:
        self.items.append(item)
        self._open = item
        return [self._event("response.output_item.added", output_index=self._index(), item=_copy(item))]

    def _close(self) -> list[str]:
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = "incomplete" if self.finish_reason == "length" else "completed"
        index = self.items.index(item)
        if item["type"] == "message":
            part = item["content"][0]
            out = [self._event("response.output_text.done", item_id=item["id"], output_index=index,
                               content_index=0, text=part["text"], logprobs=[]),
                   self._event("response.content_part.done", item_id=item["id"], output_index=index,
                               content_index=0, part=dict(part))]
        else:
            out = [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                               name=item["name"], arguments=item["arguments"])]
        out.append(self._event("response.output_item.done", output_index=index, item=_copy(item)))
        return out

    def _index(self) -> int:
        return len(self.items) - 1

    def _event(self, kind: str, **fields) -> str:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return _sse(event)

    # -- the response object ----------------------------------------------------------------------
    def snapshot(self, status: str) -> dict:
        req = self.req
        done = status in ("completed", "incomplete")
        fmt = req.text.format if req.text and req.text.format else None
        tool_choice = req.tool_choice or "auto"
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": req.model,
            "output": [_copy(i) for i in self.items] if done else [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": None, "reasoning": {"effort": None, "summary": None},
            "store": False, "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": tool_choice if isinstance(tool_choice, str) else tool_choice.model_dump(),
            "tools": [t.model_dump() for t in req.tools or ()], "truncation": req.truncation or "disabled",
            "metadata": req.metadata or {}, "user": req.user,
            "usage": _usage(self.usage()) if done else None,
        }


def _usage(chat: dict) -> dict:
    return {"input_tokens": chat["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": chat["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": chat["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat["total_tokens"]}


def _copy(item: dict) -> dict:
    return json.loads(json.dumps(item))
