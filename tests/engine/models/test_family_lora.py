"""LoRA adapters on the families whose checkpoints name q/k/v and gate/up apart (PEFT's target modules):
Gemma 2 (the adapter's o/down deltas before Gemma's output norms, windows, soft-caps) and Qwen3 (q/k deltas
before the per-head norms) match PEFT + transformers with chunked prefill and forced preemption. Phi-3
stores qkv_proj and gate_up_proj fused, which PEFT adapters then target: refused by name."""

from __future__ import annotations

import pytest

from services import LLM, SamplingParams
from tests.engine.conftest import make_tiny_model
from tests.engine.lora_adapters import check_adapter_matches_peft, peft_model, save_random_adapter
from tests.engine.models.test_families import VARIANTS, prompts_for

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.mark.parametrize("name", ["gemma2-softcaps", "qwen3-head-dim"])
def test_adapters_match_peft(name, tmp_path):
    arch, overrides, _ = VARIANTS[name]
    model_dir = make_tiny_model(tmp_path / name, arch, perturb_norms=True, **overrides)
    adapter = save_random_adapter(model_dir, tmp_path / "adapter", seed=3)
    reference = peft_model(model_dir, {"A": adapter})
    check_adapter_matches_peft(model_dir, adapter, reference, prompts_for(name, 12)[:4], name)


def test_fused_phi3_modules_are_refused_by_name(tmp_path):
    arch, overrides, _ = VARIANTS["phi3-longrope-window"]
    model_dir = make_tiny_model(tmp_path / "phi3", arch, **overrides)
    adapter = save_random_adapter(model_dir, tmp_path / "adapter", seed=3, targets=["qkv_proj", "o_proj"])
    llm = LLM(model=str(model_dir), dtype="float32", max_loras=1, max_lora_rank=8)
    with pytest.raises(Exception, match="qkv_proj"):
        llm.load_lora("A", str(adapter))
