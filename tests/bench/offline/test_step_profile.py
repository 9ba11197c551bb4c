"""`bench throughput --profile` on the engine as it is: the profiler wraps every family's parts (dense
linears, expert layers, MLA's attention), accounts each step to the parts, and leaves the engine exactly as
it found it (its outputs after detaching equal those before attaching)."""

from __future__ import annotations

import pytest

from services import LLM, SamplingParams
from services.bench.offline.step_profile import PARTS, StepProfiler
from services.bench.offline.throughput import run_ours
from services.bench.offline.workloads import offline_workload
from tests.engine.conftest import make_tiny_model
from tests.engine.models.test_families import VARIANTS


def _parts(layer) -> dict:
    return {name: getattr(layer, name) for name in ("qkv", "o", "gate_up", "down", "mla", "moe")}


@pytest.mark.parametrize("variant", ["llama", "qwen3-moe-dense-first", "deepseek-v3-mla"])
def test_the_profile_accounts_every_step_and_restores_the_engine(tmp_path, variant):
    if variant == "llama":
        model = make_tiny_model(tmp_path / variant)
    else:
        arch, overrides = VARIANTS[variant][0], VARIANTS[variant][1]
        model = make_tiny_model(tmp_path / variant, arch, **overrides)
    llm = LLM(model=str(model), dtype="float32", num_kv_blocks=256)
    requests = offline_workload("w3", vocab_size=49152, seed=1, scale=0.25)[:6]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [r.prompt_token_ids for r in requests]
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    layer_parts = [_parts(layer) for layer in llm.runner.model.layers]

    profiler = StepProfiler()
    result = run_ours(llm, requests, profiler)
    summary = profiler.summary()

    every = summary["all"]
    assert every["steps"] == result["steps"] == len(profiler.records) > 0
    by_part = every["ms_per_step_by_part"]
    assert set(PARTS) <= set(by_part)
    # Each wrapped part ran and took time; W3's shared prefixes are hits after the first request.
    for part in ("inputs", "gemm", "lm_head", "kv_write", "prefill_attention", "sampling"):
        assert by_part[part] > 0, (part, by_part)
    assert every["prefix_hit_tokens"] == result["prefix_hit_tokens"] > 0
    assert sum(r.tokens for r in profiler.records) == sum(len(r.prompt_token_ids) for r in requests) \
        + sum(r.output_len for r in requests) - len(requests) - result["prefix_hit_tokens"]

    # Detached: the layers hold their own parts again and the outputs are unchanged.
    assert [_parts(layer) for layer in llm.runner.model.layers] == layer_parts
    assert "execute" not in vars(llm.runner) and "forward" not in vars(llm.runner.model)
    after = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert after == before
