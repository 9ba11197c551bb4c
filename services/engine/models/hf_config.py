"""Reading a checkpoint's config.json the way transformers reads it, and auditing every field.

The raw dict goes through transformers' own config class for its `model_type` (so legacy spellings
such as `rope_scaling`, `rope_theta`, Gemma 3's `rope_local_base_freq`, Qwen2's `use_sliding_window`
or Phi-3's `su` scaling mean exactly what they mean to transformers), then through the family's
`FieldAudit`: every field of that config class is either implemented (read into the DecoderSpec),
unable to change inference output (dropout, token ids, initialisation), or accepted only at the
values the decoder implements, anything else refused with a message naming the field and its value.
Keys that are not fields of the config class are ignored by transformers' modeling code as well.
A test holds each audit to its transformers class (tests/engine/models/test_config_audit.py), so a
field added by a new transformers release fails the suite until it is classified.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from services.engine.models.spec import UnsupportedModelError

# PreTrainedConfig's own fields: labels, output switches, bookkeeping. None changes a causal LM's logits
# (dtype is the engine's --dtype; chunk_size_feed_forward only splits a computation).
GENERIC_NO_MATH = frozenset({
    "architectures", "chunk_size_feed_forward", "dtype", "id2label", "is_encoder_decoder", "label2id",
    "output_hidden_states", "problem_type", "return_dict", "transformers_version",
})
# Family fields that cannot change inference output: dropout probabilities (no dropout at inference),
# special token ids (the scheduler reads them from the config itself), initialisation, caching switches,
# and Llama's pretraining_tp (transformers 5 ignores it: its sliced matmul summed to the same product).
COMMON_NO_MATH = frozenset({
    "attention_dropout", "embd_pdrop", "resid_pdrop", "bos_token_id", "eos_token_id", "pad_token_id",
    "initializer_range", "use_cache", "pretraining_tp",
})


@dataclass(frozen=True)
class FieldAudit:
    implemented: frozenset[str]
    no_math: frozenset[str] = COMMON_NO_MATH
    # Fields accepted only at these values; anything else is refused by name.
    only: dict[str, tuple] = field(default_factory=dict)

    def classified(self) -> frozenset[str]:
        return self.implemented | self.no_math | frozenset(self.only) | GENERIC_NO_MATH

    def check(self, cfg, architecture: str) -> None:
        for name, allowed in self.only.items():
            value = getattr(cfg, name, None)
            if value not in allowed:
                raise UnsupportedModelError(
                    f"{architecture}: config field {name}={value!r} is not supported (pagedserve serves "
                    f"{name} in {list(allowed)} only)")


def unclassified_fields(config_class, audit: FieldAudit) -> list[str]:
    """Fields of a transformers config class that `audit` says nothing about (the audit test's check)."""
    return sorted({f.name for f in dataclasses.fields(config_class)} - audit.classified())


def parse_config(raw: dict, model_type: str):
    """The transformers config object of `raw`, as `AutoConfig` would build it."""
    from transformers import CONFIG_MAPPING

    data = {k: v for k, v in raw.items() if k != "model_type"}
    try:
        return CONFIG_MAPPING[model_type].from_dict(data)
    except (TypeError, ValueError) as e:  # transformers' strict validation: name what it refused
        raise UnsupportedModelError(f"config.json does not load as a {model_type} config: {e}") from e
