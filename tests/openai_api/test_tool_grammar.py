"""The tool-call grammar, run through llguidance with the real tokenizer: what each tool_choice lets the
model write, and what it refuses (other functions, arguments off the schema, a second call when
parallel_tool_calls is false, text where a call is required)."""

from __future__ import annotations

import pytest

from services.openai_api.tool_grammar import MAX_CALLS, tool_grammar
from services.openai_api.tool_prompt import ToolUse, render_call

llguidance = pytest.importorskip("llguidance")

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
PARIS = render_call("get_weather", '{"city": "Paris", "days": 2}')
SUM = render_call("add", '{"a": 1, "b": 2}')


@pytest.fixture(scope="module")
def accepts(smol_tokenizer):
    tok = smol_tokenizer.fast
    eos = tok.token_to_id("<|im_end|>")
    llt = llguidance.LLTokenizer(tok.to_str(), n_vocab=tok.get_vocab_size(), eos_token=[eos])

    def check(tools: ToolUse, text: str) -> bool:
        """Whether the grammar lets the model write `text` and then end."""
        m = llguidance.LLMatcher(llt, llguidance.grammar_from("lark", tool_grammar(tools)), log_level=0)
        assert not m.is_error(), m.get_error()
        ids = tok.encode(text, add_special_tokens=False).ids + [eos]
        return all(m.consume_token(t) for t in ids)

    return check


def use(choice: str, parallel: bool = True, names=("get_weather", "add")) -> ToolUse:
    schemas = {"get_weather": WEATHER, "add": ADD}
    return ToolUse(choice, tuple(names), parallel, tuple(schemas[n] for n in names))


def test_required_takes_one_or_more_calls_and_nothing_else(accepts):
    assert accepts(use("required"), PARIS)
    assert accepts(use("required"), PARIS + "\n" + SUM)
    assert not accepts(use("required"), "I'd rather chat.")
    assert not accepts(use("required"), render_call("get_weather", '{"town": "Paris"}'))  # off the schema
    assert not accepts(use("required"), render_call("rm", '{}'))
    assert not accepts(use("required", parallel=False), PARIS + "\n" + SUM)
    assert accepts(use("required"), "\n".join([PARIS] * MAX_CALLS))
    assert not accepts(use("required"), "\n".join([PARIS] * (MAX_CALLS + 1)))  # a bounded answer
    assert accepts(use("required", parallel=False), PARIS)


def test_named_takes_exactly_one_call_to_that_function(accepts):
    named = use("named", names=("add",))
    assert accepts(named, SUM)
    assert not accepts(named, PARIS)
    assert not accepts(named, SUM + "\n" + SUM)


def test_auto_lets_text_run_until_the_tag_and_holds_the_call_after_it(accepts):
    auto = use("auto")
    assert accepts(auto, "No tool needed, a < b and <tool isn't a tag.")
    assert accepts(auto, "Let me check.\n" + PARIS + "\n" + SUM)
    assert not accepts(auto, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": 5}}')
    assert not accepts(auto, "Let me check.\n<tool_call>\nplain words")


def test_a_tool_without_parameters_takes_any_object(accepts):
    free = ToolUse("required", ("ping",), True, ({},))
    assert accepts(free, render_call("ping", '{"anything": [1, "x"]}'))
    assert not accepts(free, render_call("ping", '[1]'))
