"""Sampling parameters of one request, validated on construction.

Every invalid value raises `InvalidRequestError` naming the field, so the HTTP layers can turn it into
a 400 and the offline API into a ValueError before anything is queued.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.structured_output.params import StructuredOutputsParams


class InvalidRequestError(ValueError):
    """A request that can never be served as given; `field` names the offending parameter."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


# Below this a temperature only divides logits into overflow: such a request is greedy (vLLM does the same).
MIN_TEMPERATURE = 1e-5
_INT64 = (-(2**63), 2**63 - 1)
_TOKEN_ID_LIMIT = 2**31


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k: the sampled token's logprob plus the top-k alternatives
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = None  # prefix-cache isolation: blocks of different salts never match
    # Beam search (vLLM's extension): n beams, scored as transformers' generate(num_beams=n) does.
    use_beam_search: bool = False
    length_penalty: float = 1.0  # finished beams score cumulative logprob / generated_tokens ** length_penalty
    early_stopping: bool | str = False  # True, False or "never", as in transformers
    # Guided decoding: every sample's output is constrained to this JSON schema, regex, choice or grammar.
    structured_outputs: StructuredOutputsParams | None = None
    stop_strings: list[str] = field(init=False, default_factory=list)

    MAX_LOGPROBS = 20
    MAX_STOP_STRINGS = 16
    MAX_STOP_CHARS = 1024
    MAX_STOP_TOKEN_IDS = 256

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop_strings = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @property
    def effective_temperature(self) -> float:
        """What the engine samples with: 0 (greedy) for temperatures too small to divide logits by."""
        return 0.0 if self.temperature < MIN_TEMPERATURE else float(self.temperature)

    def validate(self) -> None:
        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        if not is_int(self.n) or self.n < 1 or self.n > 128:
            raise InvalidRequestError("n", f"must be an integer in [1, 128], got {self.n!r}")
        if not is_num(self.temperature) or self.temperature < 0:
            raise InvalidRequestError("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if not is_num(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or not -1 <= self.top_k < _TOKEN_ID_LIMIT:
            raise InvalidRequestError("top_k", f"must be -1 (disabled) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and (not is_int(self.seed) or not _INT64[0] <= self.seed <= _INT64[1]):
            raise InvalidRequestError("seed", f"must be a 64-bit signed integer, got {self.seed!r}")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or not 1 <= self.max_tokens <= _INT64[1]):
            raise InvalidRequestError("max_tokens", f"must be a positive integer, got {self.max_tokens!r}")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= _INT64[1]:
            raise InvalidRequestError("min_tokens", f"must be a non-negative integer, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError("min_tokens", "must not exceed max_tokens")
        for s in self.stop_strings:
            if not isinstance(s, str) or not s or len(s) > self.MAX_STOP_CHARS:
                raise InvalidRequestError("stop", f"must be non-empty strings of at most {self.MAX_STOP_CHARS} "
                                          f"characters, got {s!r:.80}")
        if len(self.stop_strings) > self.MAX_STOP_STRINGS:
            raise InvalidRequestError("stop", f"at most {self.MAX_STOP_STRINGS} stop strings")
        if len(self.stop_token_ids) > self.MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError("stop_token_ids", f"at most {self.MAX_STOP_TOKEN_IDS} stop token ids")
        for t in self.stop_token_ids:
            if not is_int(t) or not 0 <= t < _TOKEN_ID_LIMIT:
                raise InvalidRequestError("stop_token_ids", f"must be token ids (non-negative integers), got {t!r}")
        if self.logprobs is not None and (
            not is_int(self.logprobs) or not (0 <= self.logprobs <= self.MAX_LOGPROBS)
        ):
            raise InvalidRequestError("logprobs", f"must be an integer in [0, {self.MAX_LOGPROBS}]")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt
                                            or len(self.cache_salt) > 256):
            raise InvalidRequestError("cache_salt", "must be a non-empty string of at most 256 characters")
        if self.structured_outputs is not None:
            from services.structured_output.params import StructuredOutputsParams

            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise InvalidRequestError("structured_outputs", "must be a StructuredOutputsParams")
        if not isinstance(self.use_beam_search, bool):
            raise InvalidRequestError("use_beam_search", f"must be a boolean, got {self.use_beam_search!r}")
        if not is_num(self.length_penalty):
            raise InvalidRequestError("length_penalty", f"must be a finite number, got {self.length_penalty!r}")
        if self.early_stopping not in (True, False, "never") or not isinstance(self.early_stopping, (bool, str)):
            raise InvalidRequestError("early_stopping", f'must be true, false or "never", got {self.early_stopping!r}')
        if self.use_beam_search:
            self._validate_beam_search()

    def _validate_beam_search(self) -> None:
        """Beam search is deterministic: what would change a token choice is refused, never ignored."""
        if self.effective_temperature != 0:
            raise InvalidRequestError("temperature", "must be 0 with beam search (it ranks beams, it does not sample)")
        if self.top_p != 1.0 or self.top_k not in (-1, 0) or self.seed is not None:
            name = "top_p" if self.top_p != 1.0 else "top_k" if self.top_k not in (-1, 0) else "seed"
            raise InvalidRequestError(name, "is not supported with beam search")
        if self.min_tokens:
            raise InvalidRequestError("min_tokens", "is not supported with beam search")
        if self.stop_strings:
            raise InvalidRequestError("stop", "stop strings are not supported with beam search (stop_token_ids are)")
        if self.structured_outputs is not None:
            raise InvalidRequestError("structured_outputs", "is not supported with beam search")
