"""Stream chunks from cumulative engine outputs: the first token is announced at once, even without text."""

from __future__ import annotations

from services.replica.accumulator import ResponseAccumulator
from services.scheduler.request_output import CompletionOutput, RequestOutput


def _out(text: str, ids: list[int], reason: str | None = None) -> RequestOutput:
    return RequestOutput("r", [1, 2], [CompletionOutput(0, text, ids, reason)], reason is not None)


def _acc(kind: str) -> ResponseAccumulator:
    return ResponseAccumulator(kind, "r", "m", 1, [2], token_text=str, want_logprobs=False)


def test_completion_stream_opens_at_the_first_token_even_before_it_has_text():
    acc = _acc("completion")
    # Half a UTF-8 character: no text yet, but the client hears at once that generation began.
    first = acc.update(0, _out("", [224]))
    assert [c["text"] for c in first] == [""]
    assert acc.update(0, _out("", [224, 162])) == []  # later tokens without text add no empty chunks
    assert [c["text"] for c in acc.update(0, _out("\u05e6", [224, 162, 116]))] == ["\u05e6"]
    last = acc.update(0, _out("\u05e6", [224, 162, 116, 0], "length"))
    assert [(c["text"], c["finish_reason"]) for c in last] == [("", "length")]
    # What was streamed is exactly the final text.
    assert "".join(c["text"] for c in first + last) + "\u05e6" == acc.response()["choices"][0]["text"]


def test_chat_stream_opens_with_the_role_then_only_text():
    acc = _acc("chat")
    first = acc.update(0, _out("", [7]))
    assert first[0]["delta"] == {"role": "assistant", "content": ""}
    assert acc.update(0, _out("", [7, 8])) == []
    assert acc.update(0, _out("hi", [7, 8, 9]))[0]["delta"] == {"content": "hi"}
