"""Sampling parameters of one request, validated on construction.

Every invalid value raises `InvalidRequestError` naming the field, so the HTTP layers can turn it into
a 400 and the offline API into a ValueError before anything is queued.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.request.errors import InvalidRequestError

if TYPE_CHECKING:
    from services.request.structured_outputs import StructuredOutputsParams


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
    # vLLM's penalties: presence/frequency over the tokens generated so far, repetition over prompt + output.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (OpenAI's [-100, 100])
    min_p: float = 0.0  # drop tokens whose probability is below min_p x the most likely token's
    best_of: int | None = None  # generate best_of samples, return the n with the highest cumulative logprob
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
    MAX_LOGIT_BIAS = 300
    PENALTY_RANGE = (-2.0, 2.0)  # OpenAI's range for presence and frequency penalties
    # Multiplying or dividing a logit by more than this can only overflow float32, never sample better.
    REPETITION_RANGE = (0.01, 100.0)
    BIAS_RANGE = (-100.0, 100.0)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop_strings = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @property
    def num_sequences(self) -> int:
        """Samples generated: best_of when given (the n best are returned), else n."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def penalizes(self) -> bool:
        """Any logits processor beyond temperature/top-k/top-p: penalties, logit bias or min_p."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_p)

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
            from services.request.structured_outputs import StructuredOutputsParams

            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise InvalidRequestError("structured_outputs", "must be a StructuredOutputsParams")
        self._validate_logits_processors(is_int, is_num)
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
        if (self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0 or self.min_p
                or self.logit_bias):
            name = next(n for n in ("presence_penalty", "frequency_penalty", "min_p", "logit_bias")
                        if getattr(self, n)) if self.repetition_penalty == 1.0 else "repetition_penalty"
            raise InvalidRequestError(name, "is not supported with beam search (it ranks the raw logprobs)")
        if self.best_of not in (None, self.n):
            raise InvalidRequestError("best_of", "is not supported with beam search (n is the beam width)")

    def _validate_logits_processors(self, is_int, is_num) -> None:
        lo, hi = self.PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_num(v) or not lo <= v <= hi:
                raise InvalidRequestError(name, f"must be a number in [{lo}, {hi}], got {v!r}")
        lo, hi = self.REPETITION_RANGE
        if not is_num(self.repetition_penalty) or not lo <= self.repetition_penalty <= hi:
            raise InvalidRequestError("repetition_penalty", f"must be a number in [{lo}, {hi}] (1: off), "
                                      f"got {self.repetition_penalty!r}")
        if not is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError("min_p", f"must be a number in [0, 1], got {self.min_p!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise InvalidRequestError("logit_bias", "must map token ids to biases")
            if len(self.logit_bias) > self.MAX_LOGIT_BIAS:
                raise InvalidRequestError("logit_bias", f"at most {self.MAX_LOGIT_BIAS} entries, got "
                                          f"{len(self.logit_bias)}")
            lo, hi = self.BIAS_RANGE
            for t, b in self.logit_bias.items():
                if not is_int(t) or not 0 <= t < _TOKEN_ID_LIMIT:
                    raise InvalidRequestError("logit_bias", f"keys must be token ids, got {t!r:.80}")
                if not is_num(b) or not lo <= b <= hi:
                    raise InvalidRequestError("logit_bias", f"token {t}: bias must be in [{lo}, {hi}], got {b!r:.80}")
        if self.best_of is not None and (not is_int(self.best_of) or not self.n <= self.best_of <= 128):
            raise InvalidRequestError("best_of", f"must be an integer in [n, 128] (n = {self.n}), got {self.best_of!r}")
