"""Speculative decoding's settings, as vLLM spells them: `speculative_config={"method": ..., ...}` offline,
`--speculative-config JSON` on the command line, the chart's `speculativeConfig` value.

Scheduler and engine read the same object: the scheduler proposes n-gram drafts itself, budgets every
draft token and rolls back what the engine rejects; the engine runs a draft model or an EAGLE-3 head
(its own paged KV cache over the scheduler's block tables) and verifies every draft against the target.
A key this module does not know, a method not implemented here, or a value out of range is refused with
the key named: a setting that would change what is served is never ignored.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

# Methods served here, and vLLM's other names, refused by name (each changes the math: no approximation).
METHODS = ("ngram", "draft_model", "eagle3")
_NOT_IMPLEMENTED = {
    "eagle": "EAGLE-1 heads are not implemented (eagle3 is)",
    "medusa": "Medusa heads are not implemented",
    "mlp_speculator": "MLP speculators are not implemented",
    "mtp": "multi-token-prediction layers are not implemented",
    "deepseek_mtp": "multi-token-prediction layers are not implemented",
    "suffix": "suffix decoding is not implemented (ngram is the model-free method)",
}
MAX_SPECULATIVE_TOKENS = 16  # drafts per sequence and step (the engine refuses more)
MAX_PROMPT_LOOKUP = 64
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model",
         "disable_by_batch_size", "knee_tokens")


class SpeculativeConfigError(ValueError):
    """A speculative config that cannot be served; `key` names the offending key."""

    def __init__(self, key: str, message: str):
        super().__init__(f"speculative_config.{key}: {message}")
        self.key = key


def _int(d: dict, key: str, lo: int, hi: int | None = None) -> int | None:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise SpeculativeConfigError(key, f"must be an integer, got {v!r}")
    if v < lo or (hi is not None and v > hi):
        raise SpeculativeConfigError(key, f"must be in [{lo}, {hi if hi is not None else 'inf'}], got {v}")
    return v


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None  # ngram: longest suffix matched (default: prompt_lookup_min, else 5)
    prompt_lookup_min: int | None = None  # ngram: shortest suffix matched (default: prompt_lookup_max, else 5)
    model: str | None = None  # draft_model / eagle3: the draft's directory
    # vLLM's switch: no drafts in a step while more requests than this are running (None: never by count).
    disable_by_batch_size: int | None = None
    # The step size (tokens) at which a forward pass costs as much again as its fixed part: step time
    # ~ b * (knee + tokens). None: measured online from the scheduler's own steps (services.scheduler.
    # spec_decode.policy); a number pins it.
    knee_tokens: int | None = None

    @property
    def proposer_in_engine(self) -> bool:
        """Drafts come from the engine (a model) rather than from the scheduler (n-gram lookup)."""
        return self.method != "ngram"

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """From a dict, a JSON object string (the flag, the env var, the chart), or None (no speculation)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            if not value.strip():
                return None
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise SpeculativeConfigError("<json>", f"not valid JSON: {exc}") from None
            if value is None:
                return None
        if not isinstance(value, dict):
            raise SpeculativeConfigError("<config>", f"must be a JSON object, got {type(value).__name__}")
        unknown = sorted(set(value) - set(_KEYS))
        if unknown:
            raise SpeculativeConfigError(unknown[0], f"is not a setting served here (known: {', '.join(_KEYS)})")
        method = value.get("method")
        if method in _NOT_IMPLEMENTED:
            raise SpeculativeConfigError("method", f"{method!r}: {_NOT_IMPLEMENTED[method]}")
        if method not in METHODS:
            raise SpeculativeConfigError("method", f"must be one of {', '.join(METHODS)}, got {method!r}")
        k = _int(value, "num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)
        if k is None:
            raise SpeculativeConfigError("num_speculative_tokens", "is required")
        lo = _int(value, "prompt_lookup_min", 1, MAX_PROMPT_LOOKUP)
        hi = _int(value, "prompt_lookup_max", 1, MAX_PROMPT_LOOKUP)
        model = value.get("model")
        if method == "ngram":
            if model is not None:
                raise SpeculativeConfigError("model", "the ngram method uses no draft model")
            # vLLM's defaults: one bound given stands for both; neither: 5.
            lo, hi = (lo or hi or 5), (hi or lo or 5)
            if lo > hi:
                raise SpeculativeConfigError("prompt_lookup_min", f"{lo} exceeds prompt_lookup_max {hi}")
        else:
            for key in ("prompt_lookup_min", "prompt_lookup_max"):
                if value.get(key) is not None:
                    raise SpeculativeConfigError(key, f"applies to the ngram method only, not {method}")
            if not isinstance(model, str) or not model:
                raise SpeculativeConfigError("model", f"the {method} method needs the draft's directory")
        return cls(method, k, hi, lo, model, _int(value, "disable_by_batch_size", 2),
                   _int(value, "knee_tokens", 1, 1 << 20))

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in asdict(self).items() if v is not None}, sort_keys=True)
