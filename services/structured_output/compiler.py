"""Compiling constraints into llguidance grammars, off the step loop, with limits and an LRU.

One `GrammarCompiler` per process that serves constraints (the scheduler, and the router, which
compiles only to refuse what cannot compile before it routes). Compiles run on the compiler's own
threads (llguidance drops the GIL while it builds a lexer), under llguidance's fuel and size limits
and a deadline; the first token mask is computed there too, since that is where a regex built to blow
up (nested or huge repetitions) spends its time. A constraint that fails any of this is an
`InvalidRequestError` naming the request field and the reason, never an unconstrained answer. Results,
the constraint's own failures included, are kept in an LRU keyed by the constraint, so a repeated schema
costs one lookup.

A failure that is this server's and not the constraint's (building the tokenizer's llguidance view, a
MemoryError, any exception llguidance or this code raises other than its verdict on the constraint) is
a `GrammarServiceError`: a 5xx-class error (the HTTP layers' handler for unexpected errors answers it
500 and logs it there, once per request, with the request's path; nothing here logs it again), counted
in `CompileStats.server_faults`, and never cached: the next request with the same constraint compiles
it afresh, so a transient fault does not turn a valid schema into a remembered 400.

Why llguidance: no dependencies, abi3 wheels, reads the `tokenizers` JSON directly (no transformers,
no torch in the router or scheduler), computes a 50k-token mask in tens of microseconds, and takes JSON
schemas, regexes and Lark grammars with JSON-schema sub-rules, which tool calling builds on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from services.request.errors import InvalidRequestError
from services.request.structured_outputs import StructuredOutputsParams
from services.structured_output.guide import SequenceGuide

log = logging.getLogger(__name__)

# JSON output without free whitespace: separators fixed, none between tokens (bounded by construction).
_COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_MAX_SCHEMA_DEPTH = 64
_MAX_ERROR_CHARS = 400


@dataclass(frozen=True)
class GrammarLimits:
    """llguidance's parser limits (fuel is its unit of work, ~15-50k per ms) and the compile deadline."""

    initial_lexer_fuel: int = 300_000
    step_lexer_fuel: int = 100_000
    step_max_items: int = 50_000
    max_lexer_states: int = 100_000
    max_grammar_size: int = 200_000
    deadline_s: float = 10.0


@dataclass
class CompileStats:
    """Counters since start (read by the metrics collectors; written on the compiler's threads)."""

    compiles: int = 0  # grammars built (cache misses that ran)
    compile_seconds: float = 0.0
    cache_hits: int = 0
    failures: int = 0  # constraints refused: do not compile, exceed a limit or the deadline
    server_faults: int = 0  # compiles this server failed (GrammarServiceError): never cached


class GrammarServiceError(RuntimeError):
    """The compiler failed for a reason of this server's, not the constraint's (the tokenizer, memory, a
    bug): 5xx-class, never cached. The cause is chained (`__cause__`)."""


class CompiledGrammar:
    """A grammar ready to constrain sequences: each gets its own matcher, a copy of the pristine one."""

    __slots__ = ("key", "_matcher")

    def __init__(self, key: str, matcher):
        self.key = key
        self._matcher = matcher

    def new_guide(self) -> SequenceGuide:
        return SequenceGuide(self._matcher.deep_copy())


class GrammarCompiler:
    """`tokenizer_json`: the `tokenizers` JSON of the model (or a callable returning it, read on the first
    compile); `vocab_size`: the model's (masks have a bit per id below it); `eos_token_ids`: what a
    grammar that may end allows (None: the tokenizer's own)."""

    def __init__(self, tokenizer_json: str | Callable[[], str], vocab_size: int,
                 eos_token_ids: list[int] | None = None, *, limits: GrammarLimits | None = None,
                 cache_size: int = 256, workers: int = 2):
        self.vocab_size = vocab_size
        self.limits = limits or GrammarLimits()
        self.stats = CompileStats()
        self._tokenizer_json = tokenizer_json
        self._eos = list(eos_token_ids) if eos_token_ids else None
        self._llg_tokenizer = None
        self._cache: OrderedDict[str, CompiledGrammar | InvalidRequestError] = OrderedDict()
        self._inflight: dict[str, Future] = {}
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grammar-compile")

    # -- public -------------------------------------------------------------------------------
    def submit(self, params: StructuredOutputsParams) -> Future:
        """A future of the CompiledGrammar (or of the InvalidRequestError), sharing in-flight compiles."""
        key = params.cache_key()
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self.stats.cache_hits += 1
                done: Future = Future()
                done.set_result(cached)
                return done
            fut = self._inflight.get(key)
            if fut is None:
                fut = self._pool.submit(self._compile_and_cache, key, params)
                self._inflight[key] = fut
            else:
                self.stats.cache_hits += 1
        return fut

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """Blocking, with the deadline (the offline API and the scheduler core's own fallback)."""
        return self._result(params, self._wait(self.submit(params), params))

    async def compile_async(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The same without blocking the event loop."""
        fut = self.submit(params)
        try:
            got = await asyncio.wait_for(asyncio.wrap_future(fut), self.limits.deadline_s)
        except asyncio.TimeoutError:
            got = self._timed_out(params)
        return self._result(params, got)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- worker threads -----------------------------------------------------------------------
    def _wait(self, fut: Future, params: StructuredOutputsParams):
        try:
            return fut.result(self.limits.deadline_s)
        except FutureTimeout:
            return self._timed_out(params)

    def _timed_out(self, params: StructuredOutputsParams) -> InvalidRequestError:
        self.stats.failures += 1
        return InvalidRequestError(params.field_name, f"did not compile within {self.limits.deadline_s:g} s")

    @staticmethod
    def _result(params: StructuredOutputsParams, got) -> CompiledGrammar:
        if isinstance(got, InvalidRequestError):
            # Cached errors carry the field of the request that first hit them: name this request's field.
            raise InvalidRequestError(params.field_name, got.message)
        return got

    def _compile_and_cache(self, key: str, params: StructuredOutputsParams):
        start = time.perf_counter()
        try:
            result = self._build(key, params)
        except InvalidRequestError as exc:
            result = exc
        except Exception as exc:  # the server's fault, not the constraint's: raised to the waiters, not cached
            with self._lock:
                self.stats.server_faults += 1
                self._inflight.pop(key, None)
            raise GrammarServiceError(f"the grammar compiler failed on {params.field_name} "
                                      f"({type(exc).__name__}: {_short(str(exc))})") from exc
        with self._lock:
            self.stats.compiles += 1
            self.stats.compile_seconds += time.perf_counter() - start
            if isinstance(result, InvalidRequestError):
                self.stats.failures += 1
            self._cache[key] = result
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            self._inflight.pop(key, None)
        return result

    def _tokenizer(self):
        with self._tokenizer_lock:  # not self._lock: submit() must never wait on this build
            if self._llg_tokenizer is None:
                text = self._tokenizer_json() if callable(self._tokenizer_json) else self._tokenizer_json
                self._llg_tokenizer = _shared_tokenizer(text, self.vocab_size, self._eos)
            return self._llg_tokenizer

    def _build(self, key: str, params: StructuredOutputsParams) -> CompiledGrammar:
        import llguidance

        lim = self.limits
        limits = llguidance.LLParserLimits(
            initial_lexer_fuel=lim.initial_lexer_fuel, step_lexer_fuel=lim.step_lexer_fuel,
            step_max_items=lim.step_max_items, max_lexer_states=lim.max_lexer_states,
            max_grammar_size=lim.max_grammar_size, verbose_errors=False)
        tokenizer = self._tokenizer()  # the server's: any failure here is a GrammarServiceError
        try:
            grammar = grammar_text(params)
            matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
        except ValueError as exc:  # llguidance's verdict on the constraint's text (other types: the server's)
            if isinstance(exc, InvalidRequestError):
                raise
            raise InvalidRequestError(params.field_name, _short(f"cannot be compiled: {exc}")) from None
        if matcher.is_error():
            raise InvalidRequestError(params.field_name, _short(f"cannot be compiled: {matcher.get_error()}"))
        why = _probe(matcher.deep_copy(), self._eos or [])
        if why is not None:
            raise InvalidRequestError(params.field_name, _short(f"exceeds the grammar limits: {why}"))
        return CompiledGrammar(key, matcher)


PROBE_TOKENS = 8
_TOKENIZERS: dict[tuple, object] = {}  # `serve` runs a router and a replica in one process: one of each model
_TOKENIZERS_LOCK = threading.Lock()


def _shared_tokenizer(text: str, vocab_size: int, eos: list[int] | None):
    """llguidance's view of a tokenizer (about a second to build for a 50k vocabulary), one per process."""
    import llguidance

    key = (hash(text), len(text), vocab_size, tuple(eos or ()))
    with _TOKENIZERS_LOCK:
        tok = _TOKENIZERS.get(key)
        if tok is None:
            tok = _TOKENIZERS[key] = llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=eos)
        return tok


def _probe(matcher, eos: list[int]) -> str | None:
    """Walk a few tokens into the grammar (the lowest allowed id each time) on a copy: the first masks are
    where a regex built to blow up (nested or huge repetitions) runs out of fuel, and finding that here
    costs this thread, not a step of every running sequence. Returns the error, if any."""
    for _ in range(PROBE_TOKENS):
        mask = matcher.compute_bitmask()
        if matcher.is_error():
            break
        token = _lowest_set_bit(mask, set(eos))
        if token is None or not matcher.consume_token(token) or matcher.is_stopped():
            break
    return matcher.get_error() if matcher.is_error() else None


def _lowest_set_bit(mask: bytes, skip: set[int]) -> int | None:
    words = memoryview(mask).cast("I")
    for i, w in enumerate(words):
        while w:
            low = w & -w
            token = i * 32 + low.bit_length() - 1
            if token not in skip:
                return token
            w ^= low
    return None


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint (not yet checked: the matcher does that)."""
    import llguidance

    kind = params.kind
    if kind in ("json", "json_object"):
        schema = params.schema()
        if params.strict:
            schema = _strict_schema(schema, 0, params)
        options = dict(_COMPACT_JSON) if params.whitespace_pattern is None else {
            "whitespace_flexible": True, "whitespace_pattern": params.whitespace_pattern}
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        except ValueError as exc:
            raise InvalidRequestError(params.field_name, _short(f"is not a usable JSON schema: {exc}")) from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return "start: " + " | ".join(_lark_string(c) for c in params.choice) + "\n"
    try:
        return llguidance.grammar_from("grammar", bound_json_whitespace(params.grammar))
    except Exception as exc:  # the GBNF converter raises on text it cannot read
        raise InvalidRequestError(params.field_name, _short(f"is not a Lark or GBNF grammar: {exc}")) from None


_JSON_RULE = re.compile(r"%json\s*(?=\{)")


def bound_json_whitespace(lark: str) -> str:
    """Every `%json {...}` sub-rule of a Lark grammar that sets no `x-guidance` options of its own gets the
    compact ones JSON requests get, so no grammar's JSON can loop on whitespace either."""
    out, at = [], 0
    decoder = json.JSONDecoder()
    for m in _JSON_RULE.finditer(lark):
        if m.start() < at:
            continue
        try:
            schema, end = decoder.raw_decode(lark, m.end())
        except ValueError:
            continue  # not JSON: llguidance names the error
        if isinstance(schema, dict) and "x-guidance" not in schema:
            out.append(lark[at:m.end()])
            out.append(json.dumps({**schema, "x-guidance": _COMPACT_JSON}, ensure_ascii=False))
            at = end
    out.append(lark[at:])
    return "".join(out)


def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


# Keywords whose value is a schema, a list of schemas, or a map of names to schemas.
_SUB_SCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
               "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _strict_schema(schema, depth: int, params: StructuredOutputsParams):
    """OpenAI's strict mode: objects without an explicit additionalProperties take no other properties."""
    if depth > _MAX_SCHEMA_DEPTH:
        raise InvalidRequestError(params.field_name, f"nested deeper than {_MAX_SCHEMA_DEPTH} levels")
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for k in _SUB_SCHEMA:
        if k in out:
            out[k] = (_strict_schema(out[k], depth + 1, params) if not isinstance(out[k], list)
                      else [_strict_schema(s, depth + 1, params) for s in out[k]])
    for k in _SCHEMA_LISTS:
        if isinstance(out.get(k), list):
            out[k] = [_strict_schema(s, depth + 1, params) for s in out[k]]
    for k in _SCHEMA_MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {name: _strict_schema(s, depth + 1, params) for name, s in out[k].items()}
    if ("properties" in schema or schema.get("type") == "object") and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def _short(message: str) -> str:
    first = message.strip().splitlines()[0] if message.strip() else "unknown error"
    return first if len(first) <= _MAX_ERROR_CHARS else first[:_MAX_ERROR_CHARS] + "..."
