"""quantization_config parsing: every served method read into a scheme, everything else refused naming the
method and the field (never a KeyError, never silently ignored)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.engine.quant.scheme import QuantizationConfigError, parse_quantization

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": False,
        "damp_percent": 0.01, "true_sequential": True, "static_groups": False, "model_name_or_path": None}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
       "modules_to_not_convert": None}
FP8_BLOCK = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
CT_W4A16 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head"], "config_groups": {"group_0": {
                "targets": ["Linear"], "input_activations": None, "output_activations": None,
                "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128,
                            "dynamic": False, "actorder": None, "observer": "minmax", "observer_kwargs": {}}}}}
CT_W8A8 = {"quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
           "config_groups": {"group_0": {
               "targets": ["Linear"],
               "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
               "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                     "dynamic": True}}}}


def test_served_methods_parse():
    s = parse_quantization({"quantization_config": GPTQ})
    w = s.for_module("model.layers.0.self_attn.q_proj").weight
    assert (w.layout, w.bits, w.group_size, w.act_order, w.symmetric, w.zero_offset) == ("gptq", 4, 128, True,
                                                                                         False, 1)
    assert s.for_module("lm_head") is None
    assert parse_quantization({"quantization_config": {**GPTQ, "checkpoint_format": "gptq_v2"}}).groups[0][1]\
        .weight.zero_offset == 0
    s = parse_quantization({"quantization_config": FP8_BLOCK})
    ls = s.for_module("model.layers.3.mlp.down_proj")
    assert ls.weight.block == (128, 128) and ls.activation.granularity == "group"
    s = parse_quantization({"quantization_config": CT_W4A16})
    assert s.for_module("model.layers.0.mlp.up_proj").weight.layout == "ct-packed"
    assert s.for_module("lm_head") is None
    s = parse_quantization({"quantization_config": CT_W8A8})
    assert s.for_module("model.layers.0.mlp.up_proj").activation.dtype == "int8"
    assert parse_quantization({"quantization_config": AWQ}).groups[0][1].weight.layout == "awq"
    assert parse_quantization({}) is None


@pytest.mark.parametrize("cfg,method,field", [
    ({"quant_method": "mxfp4", "future_switch": True}, "mxfp4", "future_switch"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes", "quant_method"),
    ({"quant_method": "hqq"}, "hqq", "quant_method"),
    ({**GPTQ, "bits": 3}, "gptq", "bits"),
    ({**GPTQ, "lm_head": True}, "gptq", "lm_head"),
    ({**GPTQ, "dynamic": {"-:.*down": {}}}, "gptq", "dynamic"),
    ({**GPTQ, "some_future_switch": True}, "gptq", "some_future_switch"),
    ({**AWQ, "version": "gemv"}, "awq", "version"),
    ({**FP8_BLOCK, "fmt": "e5m2"}, "fp8", "fmt"),
    ({**FP8_BLOCK, "activation_scheme": "static"}, "fp8", "activation_scheme"),
    ({**CT_W4A16, "sparsity_config": {"format": "sparse-24"}}, "compressed-tensors", "sparsity_config"),
    ({**CT_W4A16, "format": "nvfp4-pack-quantized"}, "compressed-tensors", "config_groups.group_0.format"),
])
def test_unserved_configs_are_refused_by_name(cfg, method, field):
    with pytest.raises(QuantizationConfigError) as e:
        parse_quantization({"quantization_config": cfg})
    assert (e.value.method, e.value.field) == (method, field)
    assert repr(method) in str(e.value) and repr(field) in str(e.value)


values = st.recursive(st.none() | st.booleans() | st.integers(-3, 300) | st.text(max_size=12),
                      lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                   max_size=3), max_leaves=8)


@settings(max_examples=300, deadline=None)
@given(base=st.sampled_from([GPTQ, AWQ, FP8_BLOCK, CT_W4A16, CT_W8A8]),
       key=st.sampled_from(["bits", "group_size", "desc_act", "sym", "version", "weight_block_size", "format",
                            "config_groups", "ignore", "activation_scheme", "kv_cache_scheme", "new_field"]),
       value=values)
def test_hostile_configs_parse_or_are_refused_by_name(base, key, value):
    """Any value in any field: a scheme, or QuantizationConfigError naming a field; never another error."""
    try:
        parse_quantization({"quantization_config": {**base, key: value}})
    except QuantizationConfigError as e:
        assert e.field and e.method in str(e)


def test_nested_fields_are_named_by_their_path():
    bad = {**CT_W4A16, "config_groups": {"g": {**CT_W4A16["config_groups"]["group_0"],
                                               "weights": {**CT_W4A16["config_groups"]["group_0"]["weights"],
                                                           "num_bits": 2}}}}
    with pytest.raises(QuantizationConfigError) as e:
        parse_quantization({"quantization_config": bad})
    assert e.value.field == "config_groups.g.weights.num_bits"
