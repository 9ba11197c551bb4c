"""A checkpoint whose quantization_config is not served fails at load with an error naming the method and the
field, before any weight is read (a GPTQ checkpoint once failed with a KeyError on `q_proj.weight`)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from services.engine.model_loader import load_model
from services.engine.quant.scheme import QuantizationConfigError


@pytest.mark.parametrize("qcfg,field", [
    ({"quant_method": "gptq", "bits": 3, "group_size": 128, "desc_act": False, "sym": True}, "bits"),
    ({"quant_method": "mxfp4"}, "quant_method"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32], "fmt": "e5m2"}, "fmt"),
])
def test_unserved_quantization_is_refused_at_load(tiny_model_dir, tmp_path, qcfg, field):
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["quantization_config"] = qcfg
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QuantizationConfigError) as e:
        load_model(model_dir, torch.float32, torch.device("cpu"), "reference")
    assert e.value.field == field and repr(qcfg["quant_method"]) in str(e.value)
