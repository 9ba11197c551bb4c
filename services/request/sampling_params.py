"""Sampling parameters of one request, validated on construction.

Every invalid value raises `InvalidRequestError` naming the field, so the HTTP layers can turn it into
a 400 and the offline API into a ValueError before anything is queued.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.request import limits as L
from services.request.errors import InvalidRequestError

if TYPE_CHECKING:
    from services.request.structured_outputs import StructuredOutputsParams



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
        return L.effective_temperature(self.temperature)

    def validate(self) -> None:
        """Every bound from the one table (services.request.limits), then the rules between fields."""
        L.N.check("n", self.n)
        L.TEMPERATURE.check("temperature", self.temperature)
        L.TOP_P.check("top_p", self.top_p)
        L.TOP_K.check("top_k", self.top_k)
        if self.seed is not None:
            L.SEED.check("seed", self.seed)
        if self.max_tokens is not None:
            L.MAX_TOKENS.check("max_tokens", self.max_tokens)
        L.MIN_TOKENS.check("min_tokens", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError("min_tokens", "must not exceed max_tokens")
        if len(self.stop_strings) > L.MAX_STOP_STRINGS:
            raise InvalidRequestError("stop", f"at most {L.MAX_STOP_STRINGS} stop strings")
        for s in self.stop_strings:
            if not isinstance(s, str) or not s or len(s) > L.MAX_STOP_CHARS:
                raise InvalidRequestError("stop", f"must be non-empty strings of at most {L.MAX_STOP_CHARS} "
                                          f"characters, got {s!r:.80}")
        if len(self.stop_token_ids) > L.MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError("stop_token_ids", f"at most {L.MAX_STOP_TOKEN_IDS} stop token ids")
        for t in self.stop_token_ids:
            L.TOKEN_ID.check("stop_token_ids", t)
        if self.logprobs is not None:
            L.LOGPROBS.check("logprobs", self.logprobs)
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt
                                            or len(self.cache_salt) > L.MAX_CACHE_SALT_CHARS):
            raise InvalidRequestError("cache_salt", f"must be a non-empty string of at most "
                                      f"{L.MAX_CACHE_SALT_CHARS} characters")
        if self.structured_outputs is not None:
            from services.request.structured_outputs import StructuredOutputsParams

            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise InvalidRequestError("structured_outputs", "must be a StructuredOutputsParams")
        self._validate_logits_processors()
        if not isinstance(self.use_beam_search, bool):
            raise InvalidRequestError("use_beam_search", f"must be a boolean, got {self.use_beam_search!r}")
        L.LENGTH_PENALTY.check("length_penalty", self.length_penalty)
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

    def _validate_logits_processors(self) -> None:
        L.PENALTY.check("presence_penalty", self.presence_penalty)
        L.PENALTY.check("frequency_penalty", self.frequency_penalty)
        L.REPETITION_PENALTY.check("repetition_penalty", self.repetition_penalty)
        L.MIN_P.check("min_p", self.min_p)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise InvalidRequestError("logit_bias", "must map token ids to biases")
            if len(self.logit_bias) > L.MAX_LOGIT_BIAS:
                raise InvalidRequestError("logit_bias", f"at most {L.MAX_LOGIT_BIAS} entries, got "
                                          f"{len(self.logit_bias)}")
            for t, b in self.logit_bias.items():
                if not L.TOKEN_ID.admits(t):
                    raise InvalidRequestError("logit_bias", f"keys must be token ids, got {t!r:.80}")
                if not L.LOGIT_BIAS.admits(b):
                    raise InvalidRequestError("logit_bias", f"token {t}: bias must be {L.LOGIT_BIAS.describe()}, "
                                              f"got {b!r:.80}")
        if self.best_of is not None:
            L.BEST_OF.check("best_of", self.best_of)
            if self.best_of < self.n:
                raise InvalidRequestError("best_of", f"must be >= n ({self.n}), got {self.best_of}")
