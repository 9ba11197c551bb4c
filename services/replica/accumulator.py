"""The response of one OpenAI request as its engine outputs arrive: stream deltas, then the whole.

Engine outputs are cumulative per request; a completions request with several prompts is several
engine requests, and each has n samples: choice index = prompt index * n + sample index.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.openai_api.tool_prompt import ToolUse
from services.replica import openai_bodies as R
from services.replica.tool_calls import ToolCallParser
from services.scheduler.request_output import RequestOutput


@dataclass
class _Choice:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    reason: str | None = None
    sent_text: int = 0  # characters already streamed
    sent_tokens: int = 0
    started: bool = False  # chat streams open each choice with a role delta
    calls: ToolCallParser | None = None  # reads tool calls out of the text when tools are offered

    @property
    def finish_reason(self) -> str | None:
        if self.reason == "stop" and self.calls is not None and self.calls.calls:
            return "tool_calls"
        return self.reason


class ResponseAccumulator:
    def __init__(self, kind: str, request_id: str, model: str, n: int, prompt_lens: list[int],
                 token_text: R.TokenText, want_logprobs: bool, include_usage: bool = False,
                 tools: ToolUse | None = None, echo: list[str] | None = None):
        self.kind, self.request_id, self.model, self.n = kind, request_id, model, n
        self.prompt_lens = prompt_lens
        self.token_text = token_text
        self.want_logprobs = want_logprobs
        self.include_usage = include_usage
        self.echo = echo  # per prompt: the text its choices begin with (completions' echo)
        self.created = R.now()
        self.choices = [_Choice(calls=ToolCallParser(tools.names) if tools else None)
                        for _ in range(n * len(prompt_lens))]
        self.cached = [0] * len(prompt_lens)
        self.error: str | None = None
        self.error_kind: str | None = None  # "request" (this request's own failure) or "engine"

    def update(self, prompt_idx: int, out: RequestOutput) -> list[dict]:
        """Absorb a cumulative output; return the stream-chunk choices it adds."""
        self.cached[prompt_idx] = out.num_cached_tokens
        if out.error and not self.error:
            self.error, self.error_kind = out.error, out.error_kind
        deltas = []
        for o in out.outputs:
            c = self.choices[prompt_idx * self.n + o.index]
            text = o.text if self.echo is None else self.echo[prompt_idx] + o.text
            c.text, c.token_ids, c.logprobs = text, list(o.token_ids), list(o.logprobs or [])
            newly_finished = o.finish_reason is not None and c.reason is None
            c.reason = o.finish_reason if o.finish_reason is not None else c.reason
            delta = c.text[c.sent_text:] if len(c.text) > c.sent_text else ""
            # A choice's first chunk goes out with its first token even while that token has no text yet
            # (a partial UTF-8 character, a special token): the client learns at once that generation
            # began, as vLLM streams it. Chat's first chunk carries the assistant role.
            opens = not c.started and (self.kind == "chat" or bool(c.token_ids) or bool(c.text))
            if not delta and not newly_finished and not opens:
                continue
            deltas.extend(self._stream_choices(prompt_idx * self.n + o.index, c, delta, newly_finished))
        return deltas

    def _stream_choices(self, index: int, c: _Choice, delta: str, finished: bool) -> list[dict]:
        """The stream choices one update of a choice adds: its text (or, with tools, the content the
        parser settles) and then each tool-call delta on its own, as OpenAI streams them."""
        lps = None
        new_ids = c.token_ids[c.sent_tokens:]
        if self.want_logprobs and new_ids:
            entries = c.logprobs[c.sent_tokens:c.sent_tokens + len(new_ids)]
            lps = self._logprobs(entries, new_ids, c.sent_text)
        first = not c.started
        c.started = True
        c.sent_text += len(delta)
        c.sent_tokens = len(c.token_ids)
        if c.calls is None:
            return [R.choice(self.kind, index, delta, c.finish_reason, lps, first=first, stream=True)]
        content, calls = c.calls.feed(delta)
        if finished:
            more_content, more_calls = c.calls.finish()
            content, calls = content + more_content, calls + more_calls
        out = []
        if content or first or (finished and not calls):
            out.append(R.choice(self.kind, index, content, None, lps, first=first, stream=True))
            lps = None
        out.extend(R.choice(self.kind, index, "", None, lps if k == 0 else None, stream=True,
                            tool_calls=[d.as_openai()]) for k, d in enumerate(calls))
        if finished:
            out[-1]["finish_reason"] = R.finish_reason(c.finish_reason)
        return out

    def _logprobs(self, entries, token_ids, offset) -> dict:
        if self.kind == "chat":
            return R.chat_logprobs(entries, token_ids, self.token_text)
        return R.completion_logprobs(entries, token_ids, self.token_text, offset)

    @property
    def finished(self) -> bool:
        return all(c.reason is not None for c in self.choices)

    def usage(self) -> dict:
        return R.usage(sum(self.prompt_lens), sum(len(c.token_ids) for c in self.choices), sum(self.cached))

    def chunks(self, choices: list[dict]) -> list[dict]:
        """Stream chunks for the choices of one update: a choice appears once per chunk, so a choice with
        several deltas (content, then tool-call pieces) spreads over consecutive chunks."""
        out: list[list[dict]] = []
        for ch in choices:
            if not out or any(other["index"] == ch["index"] for other in out[-1]):
                out.append([])
            out[-1].append(ch)
        return [R.envelope(self.kind, self.request_id, self.model, self.created, group, stream=True,
                           with_usage_field=self.include_usage) for group in out]

    def usage_chunk(self) -> dict:
        return R.envelope(self.kind, self.request_id, self.model, self.created, [], stream=True,
                          usage_obj=self.usage())

    def response(self) -> dict:
        choices = []
        for i, c in enumerate(self.choices):
            lps = self._logprobs(c.logprobs, c.token_ids, 0) if self.want_logprobs else None
            if c.calls is None:
                choices.append(R.choice(self.kind, i, c.text, c.reason, lps))
            else:
                calls = [t.as_openai() for t in c.calls.calls]
                choices.append(R.choice(self.kind, i, c.calls.content, c.finish_reason, lps, tool_calls=calls))
        return R.envelope(self.kind, self.request_id, self.model, self.created, choices, stream=False,
                          usage_obj=self.usage())
