"""Tool calls read out of one choice's output text as it grows: content deltas and call deltas, exactly.

The text arrives in pieces (services.replica.accumulator feeds whatever the engine has made visible) and
the parser is a state machine over characters, so what it emits, concatenated, does not depend on how the
text was cut: a streamed answer equals the non-streamed one by construction, not by re-parsing.

Format (services.openai_api.tool_prompt): `<tool_call>` ws `{` ws `"name"` ws `:` ws string ws `,` ws
`"arguments"` ws `:` ws object ws `}` ws `</tool_call>`. As the detokenizer holds back what may begin a
stop string, text that may begin `<tool_call>` is held until the next characters settle it. A call is
announced (id and name) once its head is complete and names an offered function, so nothing announced is
ever taken back; until then a head that stops matching is released as ordinary content. Arguments are
streamed character by character as the model writes them, up to the brace that closes them; the call's
closing `}` and tag are syntax, never shown. Whitespace next to a call is not content (OpenAI's answers
with calls carry no stray newlines), so trailing whitespace is held until text follows it.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass

from services.openai_api.tool_prompt import CALL_CLOSE, CALL_OPEN

_ALPHABET = string.ascii_letters + string.digits
_WS = " \t\r\n"
_MAX_NAME = 64  # function names are at most 64 characters (services.openai_api.protocol.FunctionName)
# The head of a call after its opening tag, as (kind, text): "lit" must appear verbatim, "ws" is optional
# whitespace, "str" the function's name as a JSON string.
_HEAD = [("ws", ""), ("lit", "{"), ("ws", ""), ("lit", '"name"'), ("ws", ""), ("lit", ":"), ("ws", ""),
         ("str", ""), ("ws", ""), ("lit", ","), ("ws", ""), ("lit", '"arguments"'), ("ws", ""), ("lit", ":"),
         ("ws", "")]


def call_id() -> str:
    return "call_" + "".join(secrets.choice(_ALPHABET) for _ in range(24))


@dataclass
class CallDelta:
    """One piece of a call: its first has `id` and `name`, the rest carry `arguments` fragments."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def as_openai(self) -> dict:
        if self.id is not None:
            return {"index": self.index, "id": self.id, "type": "function",
                    "function": {"name": self.name, "arguments": self.arguments}}
        return {"index": self.index, "function": {"arguments": self.arguments}}


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class ToolCallParser:
    def __init__(self, names: tuple[str, ...]):
        self.names = set(names)
        self.calls: list[ToolCall] = []
        self.content = ""  # all content emitted so far
        self._state = "text"
        self._pending = ""  # text state: held characters; head state: the head read so far
        self._after_call = False  # whitespace right after a call is not content
        self._ws_before_tag = ""
        self._head_pos = 0  # the _HEAD element being matched
        self._lit_pos = 0  # characters of that literal matched
        self._name_chars: list[str] = []
        self._escape = False
        self._depth = 0
        self._in_string = False
        self._closed_brace = False  # after the arguments: the call's closing brace was read
        self._tag_pos = 0  # characters of the closing tag read
        self._out: list = []

    # -- public ------------------------------------------------------------------------------
    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        """Absorb new output text; return the content and call deltas it settles."""
        self._out = []
        self._run(text)
        return self._collect()

    def finish(self) -> tuple[str, list[CallDelta]]:
        """The output ended: release what was held for characters that never came."""
        self._out = []
        if self._state == "text":
            held = self._pending
            self._pending = ""
            self._content(held.rstrip(_WS) if self.calls else held)
        elif self._state == "head":
            self._abandon_head("", 0)
        # "args": a call cut short (max_tokens) keeps the arguments it streamed; "tail": the call is whole.
        self._state = "done"
        return self._collect()

    # -- the machine -------------------------------------------------------------------------
    def _collect(self) -> tuple[str, list[CallDelta]]:
        content, deltas = [], []
        for item in self._out:
            if isinstance(item, str):
                content.append(item)
            elif deltas and item.id is None and deltas[-1].id is None and deltas[-1].index == item.index:
                deltas[-1].arguments += item.arguments
            else:
                deltas.append(item)
        text = "".join(content)
        self.content += text
        return text, deltas

    def _content(self, text: str) -> None:
        if self._after_call:
            text = text.lstrip(_WS)
            if not text:
                return
            self._after_call = False
        if text:
            self._out.append(text)

    def _run(self, text: str) -> None:
        i = 0
        while i < len(text):
            if self._state == "text":
                i = self._text(text, i)
            elif self._state == "head":
                i = self._head(text, i)
            elif self._state == "args":
                i = self._args(text, i)
            elif self._state == "tail":
                i = self._tail_step(text, i)
            else:
                return  # finished: nothing more is read

    def _text(self, text: str, i: int) -> int:
        s = self._pending + text[i:]
        at = s.find(CALL_OPEN)
        if at != -1:
            before = s[:at].rstrip(_WS)
            self._content(before)
            self._ws_before_tag = s[len(before):at]  # given back if this turns out to be no call
            self._pending = ""
            self._state, self._head_pos, self._lit_pos = "head", 0, 0
            # Continue right after the tag, in `text` coordinates (the held part precedes `text[i:]`).
            return i + at + len(CALL_OPEN) - (len(s) - len(text[i:]))
        hold = _open_prefix_len(s)
        body = s[:len(s) - hold]
        hold += len(body) - len(body.rstrip(_WS))
        self._content(s[:len(s) - hold])
        self._pending = s[len(s) - hold:]
        return len(text)

    def _head(self, text: str, i: int) -> int:
        while i < len(text):
            if self._head_pos == len(_HEAD):  # the arguments' opening brace decides
                if text[i] != "{":
                    return self._abandon_head(text, i)
                name = "".join(self._name_chars)
                if name not in self.names:
                    return self._abandon_head(text, i)
                self.calls.append(ToolCall(call_id(), name))
                self._out.append(CallDelta(len(self.calls) - 1, "", self.calls[-1].id, name))
                self._state, self._pending, self._depth, self._in_string = "args", "", 0, False
                return i
            ch = text[i]
            kind, lit = _HEAD[self._head_pos]
            if kind == "ws":
                if ch in _WS:
                    self._pending += ch
                    i += 1
                else:
                    self._head_pos += 1
                continue
            if kind == "lit":
                if ch != lit[self._lit_pos]:
                    return self._abandon_head(text, i)
                self._pending += ch
                i += 1
                self._lit_pos += 1
                if self._lit_pos == len(lit):
                    self._head_pos, self._lit_pos = self._head_pos + 1, 0
                continue
            i = self._name(text, i)
        return i

    def _name(self, text: str, i: int) -> int:
        """The function name: a JSON string, its characters collected once decoded."""
        ch = text[i]
        self._pending += ch
        if self._lit_pos == 0:  # the opening quote
            if ch != '"':
                return self._abandon_head(text, i, consumed=True)
            self._lit_pos, self._name_chars, self._escape = 1, [], False
            return i + 1
        if self._escape:
            self._escape = False
            self._name_chars.append("\\" + ch)
        elif ch == "\\":
            self._escape = True
        elif ch == '"':
            try:
                self._name_chars = [json.loads('"' + "".join(self._name_chars) + '"')]
            except ValueError:
                return self._abandon_head(text, i, consumed=True)
            self._head_pos, self._lit_pos = self._head_pos + 1, 0
        elif ch < " ":
            return self._abandon_head(text, i, consumed=True)
        else:
            self._name_chars.append(ch)
            if len(self._name_chars) > _MAX_NAME:
                return self._abandon_head(text, i, consumed=True)
        return i + 1

    def _abandon_head(self, text: str, i: int, consumed: bool = False) -> int:
        """Not a call after all: the tag and its head are content; reading resumes at the character that
        broke the pattern (it may open a real call)."""
        head = self._pending[:-1] if consumed else self._pending
        self._state, self._pending = "text", ""
        self._content(self._ws_before_tag + CALL_OPEN + head)
        return i

    def _args(self, text: str, i: int) -> int:
        start = i
        while i < len(text):
            ch = text[i]
            i += 1
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    break
        piece = text[start:i]
        self.calls[-1].arguments += piece
        self._out.append(CallDelta(len(self.calls) - 1, piece))
        if self._depth == 0:
            self._state, self._closed_brace, self._tag_pos = "tail", False, 0
        return i

    def _tail_step(self, text: str, i: int) -> int:
        """The call's closing `}` and tag, whitespace around them allowed; anything else ends the call
        there (the characters read are syntax, dropped) and is read as text."""
        while i < len(text):
            ch = text[i]
            if ch in _WS and self._tag_pos == 0:
                i += 1
                continue
            if not self._closed_brace and ch == "}":
                self._closed_brace = True
                i += 1
                continue
            if self._closed_brace and ch == CALL_CLOSE[self._tag_pos]:
                self._tag_pos += 1
                i += 1
                if self._tag_pos < len(CALL_CLOSE):
                    continue
            # The tag is complete, or a malformed ending stops the call here (read on as text).
            self._state, self._after_call = "text", True
            return i
        return i


def _open_prefix_len(s: str) -> int:
    """Length of the longest suffix of `s` that is a proper prefix of the opening tag."""
    for k in range(min(len(CALL_OPEN) - 1, len(s)), 0, -1):
        if CALL_OPEN.startswith(s[-k:]):
            return k
    return 0
