"""Every field of every config class the engine accepts is classified (implemented, unable to change
inference output, or accepted only at the implemented values), and a checkpoint asking for anything
pagedserve does not serve exactly is refused at load with a message naming the field or architecture."""

from __future__ import annotations

import json

import pytest
import transformers

from services.engine.model_loader import read_config
from services.engine.models.hf_config import unclassified_fields
from services.engine.models.registry import FAMILIES, choose_model, read_spec
from services.engine.models.spec import UnsupportedModelError


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_every_field_of_the_config_class_is_classified(arch):
    family = FAMILIES[arch]
    missing = unclassified_fields(getattr(transformers, family.config_class), family.audit)
    assert not missing, f"{family.config_class} fields nobody decided about: {missing}"


def config(kind: str, arch: str, **fields) -> dict:
    """config.json as transformers writes it for model type `kind`, with `fields` set."""
    from transformers import CONFIG_MAPPING

    cfg = CONFIG_MAPPING[kind](hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=1000).to_dict()
    cfg["architectures"] = [arch]
    cfg.update(fields)
    return cfg


REFUSED = [
    # (model_type, architecture, fields, what the message must name)
    ("llama", "LlamaForCausalLM", {"hidden_act": "xielu"}, "hidden_act='xielu'"),
    ("llama", "LlamaForCausalLM", {"rope_scaling": {"rope_type": "proportional", "factor": 2.0}},
     "rope_parameters.rope_type='proportional'"),
    ("llama", "LlamaForCausalLM", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0, "mrope_section": [1, 2]}},
     "rope_parameters.mrope_section"),
    ("llama", "LlamaForCausalLM", {"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}},
     "method 'bitsandbytes'"),
    ("llama", "LlamaForCausalLM", {"quantization_config": {"quant_method": "gptq", "bits": 3}},
     "method 'gptq', field 'bits'"),
    ("gemma2", "Gemma2ForCausalLM", {"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
    ("gemma3_text", "Gemma3ForCausalLM", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
    ("qwen3", "Qwen3ForCausalLM", {"layer_types": ["full_attention", "chunked_attention"]},
     "layer_types[1]='chunked_attention'"),
    ("gemma3_text", "Gemma3ForCausalLM", {"model_type": "gemma3"}, "model_type='gemma3'"),
    ("llama", "MambaForCausalLM", {}, "MambaForCausalLM"),
    # Expert and latent-attention families: what their routing or attention cannot be.
    ("deepseek_v3", "DeepseekV3ForCausalLM", {"n_routed_experts": 12, "n_group": 8}, "n_group=8 does not divide 12"),
    ("deepseek_v3", "DeepseekV3ForCausalLM", {"attention_bias": True}, "attention_bias=True"),
    ("mixtral", "MixtralForCausalLM", {"num_local_experts": 2, "num_experts_per_tok": 3},
     "num_experts_per_tok=3 is not within 1..2"),
    ("qwen3_moe", "Qwen3MoeForCausalLM", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("gpt_oss", "GptOssForCausalLM", {"layer_types": ["full_attention", "chunked_attention"]},
     "layer_types[1]='chunked_attention'"),
]


@pytest.mark.parametrize("model_type,arch,fields,named", REFUSED, ids=[r[3] for r in REFUSED])
def test_refused_by_name(model_type, arch, fields, named, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(config(model_type, arch, **fields)))
    with pytest.raises(UnsupportedModelError) as err:
        read_spec(read_config_choice(tmp_path))
    assert named in str(err.value), str(err.value)


def read_config_choice(model_dir):
    read_config(model_dir)  # what every engine start runs first
    return choose_model(json.loads((model_dir / "config.json").read_text()))


def test_the_engine_refuses_at_start_naming_the_field(tmp_path):
    from services import LLM

    (tmp_path / "config.json").write_text(json.dumps(config("llama", "LlamaForCausalLM", hidden_act="xielu")))
    with pytest.raises(UnsupportedModelError, match="hidden_act"):
        LLM(model=str(tmp_path), dtype="float32")


ACCEPTED = [
    # Real checkpoints' spellings: what transformers maps them to is what is served.
    ("llama", "LlamaForCausalLM", {"rope_scaling": {"type": "linear", "factor": 2.0}}, "linear"),
    ("llama", "LlamaForCausalLM", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
    ("qwen2", "Qwen2ForCausalLM", {"use_sliding_window": False, "sliding_window": 131072}, "default"),
    ("phi3", "Phi3ForCausalLM", {
        "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8},
        "original_max_position_embeddings": 64, "max_position_embeddings": 256}, "longrope"),
]


@pytest.mark.parametrize("model_type,arch,fields,rope", ACCEPTED, ids=[r[0] + "-" + r[3] for r in ACCEPTED])
def test_legacy_spellings_read_as_transformers_reads_them(model_type, arch, fields, rope, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(config(model_type, arch, **fields)))
    spec = read_spec(read_config_choice(tmp_path))
    assert spec.layers[0].rope.rope_type == rope
    assert all(layer.window is None for layer in spec.layers)  # use_sliding_window=False: no window
