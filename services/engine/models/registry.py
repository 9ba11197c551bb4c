"""Which code runs a checkpoint: a pagedserve family module, chosen by the `architectures` name of its
config.json, or transformers' own model class through the transformers backend
(models/transformers_backend.py) for any other dense decoder-only architecture; anything else refused
at load with a message naming the architecture or field.
"""

from __future__ import annotations

import logging

from services.engine.models import deepseek_v3, gemma, gpt_oss, llama, moe_families, phi3, qwen3
from services.engine.models.choice import MODULE_PATH, ModelChoice
from services.engine.models.family import Family
from services.engine.models.hf_config import parse_config
from services.engine.models.spec import DecoderSpec, UnsupportedModelError
from services.engine.quant.scheme import QuantizationConfigError, parse_quantization

log = logging.getLogger(__name__)

FAMILIES: dict[str, Family] = {f.architecture: f for module in (llama, qwen3, gemma, phi3, moe_families, deepseek_v3,
                                                                 gpt_oss) for f in module.FAMILIES}
DEFAULT_ARCHITECTURE = "LlamaForCausalLM"  # a config.json without `architectures` (older Llama exports)

def architectures_of(raw: dict) -> list[str]:
    archs = raw.get("architectures") or [DEFAULT_ARCHITECTURE]
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise UnsupportedModelError(f"config field architectures={archs!r} is not a list of names")
    return archs


def choose_model(raw: dict) -> ModelChoice:
    """The path this config.json takes; UnsupportedModelError naming what cannot be served."""
    try:  # a quantization method or field the loader does not read, refused by name
        parse_quantization(raw)
    except QuantizationConfigError as e:
        raise UnsupportedModelError(str(e)) from e
    archs = architectures_of(raw)
    for arch in archs:
        family = FAMILIES.get(arch)
        if family is None:
            continue
        model_type = raw.get("model_type") or family.model_type
        if model_type != family.model_type:
            raise UnsupportedModelError(f"{arch}: config field model_type={model_type!r}; the {arch} module reads "
                                        f"{family.model_type!r} configs")
        cfg = parse_config(raw, model_type)
        family.audit.check(cfg, arch)
        return ModelChoice(arch, MODULE_PATH, family, cfg)
    from services.engine.models.transformers_backend import transformers_choice

    return transformers_choice(raw, archs, sorted(FAMILIES))


def read_spec(choice: ModelChoice) -> DecoderSpec:
    assert choice.path == MODULE_PATH
    try:
        return choice.family.build(choice.hf_config, choice.architecture)
    except UnsupportedModelError:
        raise
    except ValueError as e:  # a layer spec refusing the sizes it was given (e.g. layers/moe.py's MoeSpec)
        raise UnsupportedModelError(f"{choice.architecture}: {e}") from e
