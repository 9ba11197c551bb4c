"""The grammar compiler on the real SmolLM2 tokenizer: hostile constraints are refused by field and reason
(never another exception, never a hang), results and failures are cached, compiles never block an event
loop, and JSON whitespace is bounded (so no output can loop on it)."""

from __future__ import annotations

import asyncio
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.request.errors import InvalidRequestError
from services.request.structured_outputs import StructuredOutputsParams
from services.structured_output.compiler import (
    CompiledGrammar,
    GrammarCompiler,
    GrammarLimits,
    bound_json_whitespace,
    grammar_text,
)
from services.structured_output.guide import bitmask_bytes
from tests.openai_api.hostile_bodies import HOSTILE_GRAMMARS, HOSTILE_REGEXES, json_schemas


@pytest.fixture(scope="module")
def compiler(smol_tokenizer):
    c = GrammarCompiler(lambda: smol_tokenizer.fast.to_str(), smol_tokenizer.vocab_size, [2])
    yield c
    c.close()


def allowed(guide, tokenizer) -> list[str]:
    mask = memoryview(guide.bitmask(bitmask_bytes(tokenizer.vocab_size))).cast("I")
    ids = [w * 32 + b for w, word in enumerate(mask) for b in range(32) if word >> b & 1]
    return [tokenizer.decode([i], skip_special_tokens=False) for i in ids]


constraints = st.one_of(
    st.builds(lambda s, strict: {"json": s, "strict": strict}, json_schemas, st.booleans()),
    st.builds(lambda r: {"regex": r}, st.sampled_from(HOSTILE_REGEXES)),
    st.builds(lambda g: {"grammar": g}, st.sampled_from(HOSTILE_GRAMMARS)),
    st.builds(lambda c: {"choice": c}, st.lists(st.text(max_size=5), max_size=4)))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(constraints)
def test_any_constraint_compiles_or_is_refused_by_field(compiler, smol_tokenizer, kwargs):
    try:
        params = StructuredOutputsParams(**kwargs, source="guided_x")
        compiled = compiler.compile(params)
    except InvalidRequestError as exc:
        assert exc.field == "guided_x" and exc.message
        return
    assert isinstance(compiled, CompiledGrammar)
    guide = compiled.new_guide()
    assert guide.error is None and allowed(guide, smol_tokenizer) is not None


def test_hostile_patterns_fail_fast_and_failures_are_cached(compiler):
    for kwargs in ({"regex": "((a{100}){100}){100}"}, {"regex": "a{1000000}"},
                   {"json": {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(x{99}){99}{99}$"}},
                             "required": ["a"]}},
                   {"grammar": "start: nowhere"}, {"json": {"type": "string", "format": "no-such-format"}}):
        params = StructuredOutputsParams(**kwargs)
        start = time.monotonic()
        with pytest.raises(InvalidRequestError) as e:
            compiler.compile(params)
        assert e.value.field == params.field_name, e.value
        hits = compiler.stats.cache_hits
        again = time.monotonic()
        with pytest.raises(InvalidRequestError):
            compiler.compile(params)
        assert compiler.stats.cache_hits == hits + 1 and time.monotonic() - again < 0.05
        assert again - start < 5.0


def test_deadline_and_the_event_loop_stays_free(smol_tokenizer):
    def compiler_with(deadline_s: float) -> GrammarCompiler:
        return GrammarCompiler(lambda: smol_tokenizer.fast.to_str(), smol_tokenizer.vocab_size,
                               limits=GrammarLimits(deadline_s=deadline_s))

    async def ticks_during(coro) -> tuple[int, float, Exception | None]:
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        start, error = time.monotonic(), None
        try:
            await coro
        except InvalidRequestError as exc:
            error = exc
        ticker.cancel()
        return ticks, time.monotonic() - start, error

    patient, hasty = compiler_with(30.0), compiler_with(0.02)
    try:
        # A pattern that burns its fuel in the probe (a fraction of a second on the compiler's thread).
        ticks, took, error = asyncio.run(ticks_during(patient.compile_async(
            StructuredOutputsParams(regex="((b{100}){100}){100}"))))
        assert error is not None and "grammar limits" in error.message
        # 10 ms ticks: a loop blocked for the compile would tick once; a loaded machine ticks slower.
        assert took > 0.1 and ticks >= 5, "the event loop kept ticking while the compile ran"
        _, took, error = asyncio.run(ticks_during(hasty.compile_async(
            StructuredOutputsParams(regex="((c{100}){100}){100}", source="guided_regex"))))
        assert error is not None and error.field == "guided_regex" and "did not compile within" in error.message
        assert took < 0.5
    finally:
        patient.close()
        hasty.close()


def test_json_whitespace_is_bounded_and_strict_closes_objects(compiler, smol_tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    guide = compiler.compile(StructuredOutputsParams(json=schema)).new_guide()
    assert all(not t.isspace() for t in allowed(guide, smol_tokenizer))  # not even before the first key
    for t in smol_tokenizer.fast.encode('{"a": 1', add_special_tokens=False).ids:
        assert guide.accept(t)
    after = allowed(guide, smol_tokenizer)
    assert not any(t.isspace() for t in after) and "}" in after and "," in after  # more keys are allowed
    strict = compiler.compile(StructuredOutputsParams(json=schema, strict=True)).new_guide()
    for t in smol_tokenizer.fast.encode('{"a": 1', add_special_tokens=False).ids:
        assert strict.accept(t)
    assert "," not in allowed(strict, smol_tokenizer)  # additionalProperties: false
    wide = compiler.compile(StructuredOutputsParams(json_object=True, whitespace_pattern="[ ]{0,2}")).new_guide()
    assert wide.accept(smol_tokenizer.fast.token_to_id("{"))
    assert any(t.startswith(" ") for t in allowed(wide, smol_tokenizer))
    lark = bound_json_whitespace('start: "x" %json {"type": "object"} | %json {"x-guidance": {}}')
    assert lark.count('"whitespace_flexible": false') == 1
    assert grammar_text(StructuredOutputsParams(choice=['say "hi"', "é"])) == 'start: "say \\"hi\\"" | "é"\n'
    deep: dict = {"type": "string"}
    for _ in range(100):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(InvalidRequestError, match="nested deeper"):
        compiler.compile(StructuredOutputsParams(json=deep, strict=True))


def test_a_server_fault_is_a_service_error_never_cached_and_the_next_compile_succeeds(smol_tokenizer):
    """A tokenizer that cannot be built (a missing file, a full disk) is the server's fault: not a 400, and
    not remembered against the schema, so the same constraint compiles once the fault is gone."""
    from services.structured_output.compiler import GrammarServiceError

    calls = []

    def tokenizer_json() -> str:
        calls.append(1)
        if len(calls) == 1:
            raise OSError("tokenizer.json: no space left on device")
        return smol_tokenizer.fast.to_str()

    c = GrammarCompiler(tokenizer_json, smol_tokenizer.vocab_size, [2])
    params = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}},
                                     source="response_format")
    try:
        with pytest.raises(GrammarServiceError) as e:
            c.compile(params)
        assert not isinstance(e.value, InvalidRequestError) and isinstance(e.value.__cause__, OSError)
        assert "response_format" in str(e.value) and "no space left" in str(e.value)
        assert (c.stats.server_faults, c.stats.failures, c.stats.cache_hits) == (1, 0, 0)
        assert isinstance(c.compile(params), CompiledGrammar)  # compiled afresh: the fault was not cached
        assert c.stats.compiles == 1 and c.stats.cache_hits == 0
        assert isinstance(c.compile(params), CompiledGrammar) and c.stats.cache_hits == 1
    finally:
        c.close()


def test_memory_errors_inside_llguidance_are_the_servers_and_async_waiters_get_them(compiler, monkeypatch):
    from services.structured_output import compiler as module
    from services.structured_output.compiler import GrammarServiceError

    real = module._probe
    failing = {"left": 1}

    def probe(matcher, eos):  # the first masks, computed inside llguidance
        if failing["left"]:
            failing["left"] -= 1
            raise MemoryError()
        return real(matcher, eos)

    monkeypatch.setattr(module, "_probe", probe)
    params = StructuredOutputsParams(regex="[0-9]{3}-memory", source="guided_regex")
    faults = compiler.stats.server_faults
    with pytest.raises(GrammarServiceError) as e:
        asyncio.run(compiler.compile_async(params))
    assert isinstance(e.value.__cause__, MemoryError) and compiler.stats.server_faults == faults + 1
    assert isinstance(asyncio.run(compiler.compile_async(params)), CompiledGrammar)


def test_a_constraint_llguidance_rejects_is_a_cached_400_not_a_server_fault(compiler):
    params = StructuredOutputsParams(grammar="start: %%% not lark", source="guided_grammar")
    faults = compiler.stats.server_faults
    for _ in range(2):
        with pytest.raises(InvalidRequestError) as e:
            compiler.compile(params)
        assert e.value.field == "guided_grammar"
    assert compiler.stats.server_faults == faults
