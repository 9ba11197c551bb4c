"""The chat templates of the families the engine serves render the same token ids in the router (its
tokenizer rebuilt from the registry's bundle) and the replica (from the model directory), equal to
transformers' `apply_chat_template`, with `chat_template_kwargs` (Qwen3's `enable_thinking`) passed
through: on, off and absent. The templates here are written in the shape of each family's own (Gemma's
turns with the system prompt folded into the first user turn and a raise_exception on other roles,
Qwen3's ChatML with an empty think block when thinking is off, Phi's <|role|> ... <|end|> turns)."""

from __future__ import annotations

import shutil

import pytest

from services.model_files.tokenizer import ModelTokenizer, read_bundle
from services.openai_api.errors import APIError
from services.openai_api.prompts import prompt_token_lists
from services.openai_api.protocol import ChatCompletionRequest

QWEN3 = """{%- for message in messages %}
{%- if message.role == 'assistant' and '</think>' in message.content %}
{%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}
{%- else %}{%- set content = message.content %}{%- endif %}
{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}"""

GEMMA = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' %}{%- set first = messages[0]['content'] + '\\n\\n' %}
{%- set rest = messages[1:] %}{%- else %}{%- set first = '' %}{%- set rest = messages %}{%- endif %}
{%- for message in rest %}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif %}
{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}
{{- '<start_of_turn>' + role + '\\n' + (first if loop.first else '') + message['content'] | trim + '<end_of_turn>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"""

PHI = """{%- for message in messages %}{{- '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}
{%- endfor %}{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- else %}{{- eos_token }}{%- endif %}"""

TEMPLATES = {"qwen3": QWEN3, "gemma": GEMMA, "phi": PHI}
CHAT = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "<think>\nsmall sum\n</think>\n\n4"},
        {"role": "user", "content": "And 3 + 3?"}]


@pytest.fixture(params=sorted(TEMPLATES))
def family(request, tmp_path):
    from services.model_files.model_source import TOKENIZER_FILES, resolve_model

    src = resolve_model(None)
    for name in TOKENIZER_FILES:
        if name != "chat_template.jinja" and (src / name).exists():
            shutil.copy(src / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text(TEMPLATES[request.param])
    return request.param, tmp_path


@pytest.mark.parametrize("kwargs", [None, {"enable_thinking": False}, {"enable_thinking": True}])
def test_router_and_replica_render_what_transformers_renders(family, kwargs):
    from transformers import AutoTokenizer

    name, model_dir = family
    replica = ModelTokenizer(model_dir)
    router = ModelTokenizer(bundle=read_bundle(model_dir))  # what a router builds from the registry
    body = {"model": "m", "messages": CHAT, **({"chat_template_kwargs": kwargs} if kwargs else {})}
    req = ChatCompletionRequest.model_validate(body)
    ids = prompt_token_lists(req, replica)
    assert prompt_token_lists(req, router) == ids
    hf = AutoTokenizer.from_pretrained(str(model_dir))
    want = hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False,
                                  **(kwargs or {}))
    assert ids == [list(want)]
    text = replica.decode(ids[0], skip_special_tokens=False)
    thinking_off = bool(kwargs) and kwargs["enable_thinking"] is False
    assert text.endswith("<think>\n\n</think>\n\n") == (name == "qwen3" and thinking_off)
    assert "small sum" not in text if name == "qwen3" else True  # Qwen3 drops past thinking


def test_a_template_refusal_and_a_reserved_variable_are_400s_naming_the_field(family):
    name, model_dir = family
    tok = ModelTokenizer(model_dir)
    bad = ChatCompletionRequest.model_validate({"model": "m", "messages": CHAT,
                                                "chat_template_kwargs": {"messages": []}})
    with pytest.raises(APIError) as err:
        prompt_token_lists(bad, tok)
    assert err.value.status == 400 and err.value.param == "chat_template_kwargs"
    if name == "gemma":  # its template raises on roles out of order
        twice = ChatCompletionRequest.model_validate({"model": "m", "messages": CHAT[1:2] * 2})
        with pytest.raises(APIError, match="alternate") as err:
            prompt_token_lists(twice, tok)
        assert err.value.param == "messages"
