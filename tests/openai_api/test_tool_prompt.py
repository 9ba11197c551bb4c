"""Tools in the prompt: the fallback block on the bundled SmolLM2 template (no tools block), a Hermes-style
template's own rendering given `tools=` as transformers passes it, and the history rules (a tool message
must answer an earlier call)."""

from __future__ import annotations

import json
import shutil

import pytest

from services.model_files.tokenizer import ModelTokenizer
from services.openai_api.errors import APIError
from services.openai_api.protocol import ChatCompletionRequest
from services.openai_api.tool_prompt import native, template_messages, tool_use
from tests.conftest import TOKENIZER_FILES

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def call(call_id: str, city: str) -> dict:
    arguments = json.dumps({"city": city})
    return {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}


HISTORY = [{"role": "user", "content": "Weather in Paris and Oslo?"},
           {"role": "assistant", "content": None, "tool_calls": [call("call_1", "Paris"), call("call_2", "Oslo")]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
           {"role": "tool", "tool_call_id": "call_2", "content": "snow"}]

# A template in the style of Qwen2.5's: it reads `tools` and writes calls with arguments through tojson.
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
Tools:{% for tool in tools %}
{{ tool | tojson }}{% endfor %}<|im_end|>
{% endif %}{%- for message in messages %}<|im_start|>{{ message.role }}
{% if message.content %}{{ message.content }}{% endif %}{% for call in message.tool_calls or [] %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def req(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": HISTORY, "tools": [TOOL], **kw})


def test_the_bundled_template_gets_the_fallback_block_and_tagged_history(smol_tokenizer):
    assert not native(smol_tokenizer)
    messages, tools = template_messages(req(), smol_tokenizer)
    assert tools is None
    text = smol_tokenizer.render_chat(messages)
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert json.dumps(TOOL["function"]["parameters"])[:20] in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n<tool_call>\n') in text
    # Both results in one user turn, in order.
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nsnow\n</tool_response>" \
        "<|im_end|>" in text


def test_tool_choice_none_renders_no_tools_but_keeps_the_history(smol_tokenizer):
    messages, _ = template_messages(req(tool_choice="none"), smol_tokenizer)
    text = smol_tokenizer.render_chat(messages)
    assert "# Tools" not in text and "<tool_response>\nsunny" in text
    assert tool_use(req(tool_choice="none")) is None


def test_a_template_with_a_tools_block_renders_them_itself(tmp_path, smol_tokenizer):
    from services.model_files.model_source import resolve_model

    src = resolve_model(None)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    tok = ModelTokenizer(tmp_path)
    assert tok.template_reads_tools and native(tok)
    messages, tools = template_messages(req(), tok)
    assert tools == [TOOL]
    text = tok.render_chat(messages, tools=tools)
    assert text.startswith("<|im_start|>system\nTools:") and json.dumps(TOOL, ensure_ascii=False) in text
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text  # arguments passed as an object
    assert "<|im_start|>tool\nsunny<|im_end|>" in text
    assert tok.apply_chat_template(messages, tools=tools) == tok.fast.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("messages,param", [
    ([{"role": "tool", "tool_call_id": "call_9", "content": "x"}], "messages.0.tool_call_id"),
    ([{"role": "tool", "content": "x"}], "messages.0.tool_call_id"),
    (HISTORY[:2] + [{"role": "tool", "tool_call_id": "call_3", "content": "x"}], "messages.2.tool_call_id"),
    ([{"role": "user", "content": "x", "tool_call_id": "call_1"}], "messages.0.tool_call_id"),
    ([{"role": "user", "content": "x", "tool_calls": HISTORY[1]["tool_calls"]}], "messages.0.tool_calls"),
])
def test_a_history_that_does_not_add_up_is_a_400_naming_the_message(messages, param):
    with pytest.raises(APIError) as exc:
        tool_use(ChatCompletionRequest.model_validate({"model": "m", "messages": messages}))
    assert exc.value.status == 400 and exc.value.param == param


def test_tool_use_says_what_the_model_may_call():
    add = {"type": "function", "function": {"name": "add"}}
    assert tool_use(req(tools=[TOOL, add])).names == ("get_weather", "add")
    named = tool_use(req(tools=[TOOL, add], tool_choice={"type": "function", "function": {"name": "add"}},
                         parallel_tool_calls=False))
    assert (named.choice, named.names, named.parallel, named.schemas) == ("named", ("add",), False, ({},))
    assert tool_use(ChatCompletionRequest.model_validate({"model": "m", "messages": HISTORY[:1]})) is None
