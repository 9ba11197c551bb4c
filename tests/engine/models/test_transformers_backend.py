"""Dense decoder-only architectures with no module of their own run transformers' own model class with
pagedserve's paged attention plugged in through transformers' attention registry: greedy float32 output
token-identical to transformers, with chunked prefill, prefix hits, forced preemption and (Cohere 2)
sliding-window layers in their own KV groups; the path is logged and shown by /v1/models."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from services import LLM
from services.engine.models.spec import UnsupportedModelError
from tests.engine.conftest import hf_greedy, make_tiny_model
from tests.engine.models.test_families import MAX_TOKENS, prompts_for, run_and_check

VARIANTS = {
    "olmo": {"clip_qkv": 4.0},  # OLMo clips q/k/v: transformers' own code does it
    # Local layers with a window of 10 and a global one every fourth: two KV groups.
    "cohere2": {"sliding_window": 10, "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention",
                                                      "full_attention"], "num_hidden_layers": 4,
                "logit_scale": 0.5},
}


@pytest.mark.parametrize("arch", sorted(VARIANTS))
def test_greedy_matches_transformers(arch, tmp_path, caplog):
    model_dir = make_tiny_model(tmp_path / arch, arch, perturb_norms=True, **VARIANTS[arch])
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    prompts = prompts_for(arch, 12)
    want = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    with caplog.at_level(logging.INFO, logger="services.engine.model_loader"):
        llm = LLM(model=str(model_dir), dtype="float32", block_size=4, max_num_batched_tokens=16,
                  num_kv_blocks=400)
    assert any("runs on the transformers path" in r.message for r in caplog.records)
    assert llm.runner.info.model_path == "transformers"
    windows = llm.runner.info.kv_group_windows
    assert windows == ([0] if arch == "olmo" else [0, 10, 10, 10])
    run_and_check(arch, llm, prompts, want)


def test_what_the_transformers_path_cannot_serve_is_refused_by_name(tmp_path):
    model_dir = make_tiny_model(tmp_path / "olmo", "olmo")
    with pytest.raises(UnsupportedModelError, match="transformers path, which has no tensor parallelism"):
        LLM(model=str(model_dir), dtype="float32", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="no LoRA adapters"):
        LLM(model=str(model_dir), dtype="float32", max_loras=1)
