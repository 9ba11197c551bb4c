"""The tool-call parser: calls, content and deltas read out of growing text, identical however the text
is cut (hypothesis cuts it everywhere), and never anything announced that is taken back."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from services.openai_api.tool_prompt import render_call
from services.replica.tool_calls import ToolCallParser

NAMES = ("get_weather", "add")


def run(text: str, cuts: list[int] | None = None) -> tuple[str, list, list]:
    """Feed `text` in pieces cut at `cuts`; returns (content, calls as (name, arguments), deltas)."""
    parser = ToolCallParser(NAMES)
    bounds = sorted({0, len(text), *[c for c in cuts or () if 0 < c < len(text)]})
    content, deltas = "", []
    for a, b in zip(bounds, bounds[1:], strict=False):
        c, d = parser.feed(text[a:b])
        content, deltas = content + c, deltas + d
    c, d = parser.finish()
    content, deltas = content + c, deltas + d
    assert content == parser.content
    return content, [(t.name, t.arguments) for t in parser.calls], deltas


def from_deltas(deltas) -> list[tuple[str, str]]:
    """What a streaming client rebuilds from the deltas (OpenAI's accumulation by index)."""
    calls: dict[int, list] = {}
    for d in deltas:
        if d.id is not None:
            assert d.index not in calls and d.id.startswith("call_") and len(d.id) == 29
            calls[d.index] = [d.name, d.arguments]
        else:
            calls[d.index][1] += d.arguments
    return [tuple(calls[i]) for i in sorted(calls)]


def test_calls_between_text_are_read_and_whitespace_next_to_them_is_not_content():
    text = ("Let me look.\n" + render_call("get_weather", '{"city": "Paris", "units": ["C", {"x": "}"}]}')
            + "\n" + render_call("add", '{"a": 1, "b": 2}') + "\n\nDone.  ")
    content, calls, deltas = run(text)
    assert content == "Let me look.Done."
    assert calls == [("get_weather", '{"city": "Paris", "units": ["C", {"x": "}"}]}'), ("add", '{"a": 1, "b": 2}')]
    assert from_deltas(deltas) == calls
    assert all(json.loads(args) for _, args in calls)


def test_plain_text_passes_through_exactly():
    for text in ["Hello world.  ", "a < b and <tool but no call", "x <tool_cal", "  leading and trailing  \n"]:
        assert run(text)[:2] == (text, [])


def test_a_head_that_is_no_call_is_content_and_an_unknown_function_is_never_announced():
    text = 'see <tool_call>{"nam": 1} and <tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call> ok'
    content, calls, deltas = run(text)
    assert calls == [] and deltas == []
    assert content == text


def test_a_call_cut_short_keeps_what_was_streamed():
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b'
    content, calls, deltas = run(text)
    assert content == "" and calls == [("add", '{"a": 1, "b')] and from_deltas(deltas) == calls
    # Cut inside the head: nothing was announced, so it is all content.
    assert run('<tool_call>\n{"name": "ad')[:2] == ('<tool_call>\n{"name": "ad', [])


def test_a_call_ended_by_the_stop_string_is_whole():
    # parallel_tool_calls false stops generation at the closing tag, which the output then lacks.
    content, calls, _ = run('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n')
    assert content == "" and calls == [("add", '{"a": 1}')]


def test_escaped_names_and_strings_with_braces():
    text = '<tool_call>{"name": "get_\\u0077eather", "arguments": {"q": "a \\"}\\" {"}}</tool_call>'
    assert run(text)[1] == [("get_weather", '{"q": "a \\"}\\" {"}')]


pieces = st.sampled_from([
    "Sure. ", "\n", "  ", "<tool", "_call>", "<tool_call>", "</tool_call>", "<", "{", "}",
    render_call("add", '{"a": 1, "b": [2, {"c": "}{"}]}'), render_call("get_weather", '{"city": "Oslo"}'),
    '{"name": "add", "arguments": ', '"x"', "done", "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": "])


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(pieces, max_size=8), cuts=st.lists(st.integers(0, 400), max_size=12))
def test_any_cutting_of_the_text_gives_the_same_content_and_calls(parts, cuts):
    text = "".join(parts)
    whole = run(text)
    pieces_ = run(text, cuts)
    assert pieces_[:2] == whole[:2]
    assert from_deltas(pieces_[2]) == whole[1] == from_deltas(whole[2])
