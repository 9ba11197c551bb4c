"""The one table of request limits: every bound a request field has, read by every process that checks it.

The HTTP models (`services.openai_api.protocol`) turn these ranges into pydantic constraints,
`SamplingParams` checks them when it is built (the offline API, the router, a replica reached
directly), the scheduler checks the vocabulary-dependent rules with `vocabulary_faults`, and the
engine's wire validation (`services.engine.step_validation`) checks the sampling fields of every step
with the same `Range` objects. A bound written here is the bound everywhere: the router, a replica, the
scheduler and the engine accept and refuse the same requests, each naming the same field
(`tests/request/test_limits.py` generates requests at and beyond every bound to show it).

The temperature floor is applied once, where a request becomes a step (`effective_temperature`, called
by the scheduler's `Sequence`): the wire then carries 0 (greedy) or a temperature the sampler may divide
by, and the engine refuses anything else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.request.errors import InvalidRequestError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Token ids are checked against the model's vocabulary later; this bound keeps them within 32 bits first.
TOKEN_ID_LIMIT = 2**31


@dataclass(frozen=True)
class Range:
    """A closed, half-open or open interval of integers or finite numbers (None: unbounded that side)."""

    lo: float | None = None
    hi: float | None = None
    integer: bool = False
    lo_open: bool = False
    hi_open: bool = False

    def admits(self, value) -> bool:
        if isinstance(value, bool):  # Python's bool is an int; no request means True by 1
            return False
        if self.integer:
            if not isinstance(value, int):
                return False
        elif isinstance(value, int):
            if abs(value) > 2**1023:  # past float's range (math.isfinite would raise OverflowError)
                return False
        elif not isinstance(value, float) or not math.isfinite(value):
            return False
        if self.lo is not None and (value < self.lo or (self.lo_open and value == self.lo)):
            return False
        return self.hi is None or (value < self.hi or (not self.hi_open and value == self.hi))

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a finite number"
        if self.lo is None and self.hi is None:
            return kind
        lo = "-inf" if self.lo is None else _number(self.lo)
        hi = "inf" if self.hi is None else _number(self.hi)
        left = "(" if self.lo_open or self.lo is None else "["
        right = ")" if self.hi_open or self.hi is None else "]"
        return f"{kind} in {left}{lo}, {hi}{right}"

    def check(self, field: str, value) -> None:
        if not self.admits(value):
            raise InvalidRequestError(field, f"must be {self.describe()}, got {_short(value)}")

    def pydantic(self) -> dict:
        """The same bound as pydantic `Field` keyword arguments (for `Annotated[int | float, Field(...)]`)."""
        kw: dict = {} if self.integer else {"allow_inf_nan": False}
        if self.lo is not None:
            kw["gt" if self.lo_open else "ge"] = self.lo
        if self.hi is not None:
            kw["lt" if self.hi_open else "le"] = self.hi
        return kw


MAX_N = 128  # n, best_of and beam width
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 300  # entries of logit_bias
MAX_CACHE_SALT_CHARS = 256
MIN_TEMPERATURE = 1e-5  # below this a temperature only divides logits into overflow: greedy (as vLLM)

# Every ranged field of a request, by its name in SamplingParams and the HTTP bodies.
N = Range(1, MAX_N, integer=True)
BEST_OF = Range(1, MAX_N, integer=True)  # and >= n: a rule between two fields, in SamplingParams
TEMPERATURE = Range(0.0)
TOP_P = Range(0.0, 1.0, lo_open=True)
TOP_K = Range(-1, TOKEN_ID_LIMIT, integer=True, hi_open=True)  # -1 or 0: off; and <= the vocabulary
SEED = Range(INT64_MIN, INT64_MAX, integer=True)
MAX_TOKENS = Range(1, INT64_MAX, integer=True)
MIN_TOKENS = Range(0, INT64_MAX, integer=True)
LOGPROBS = Range(0, MAX_LOGPROBS, integer=True)
TOKEN_ID = Range(0, TOKEN_ID_LIMIT, integer=True, hi_open=True)  # and < the vocabulary
PENALTY = Range(-2.0, 2.0)  # presence_penalty, frequency_penalty (OpenAI's range)
# Multiplying or dividing a logit by more than this can only overflow float32, never sample better.
REPETITION_PENALTY = Range(0.01, 100.0)
MIN_P = Range(0.0, 1.0)
LOGIT_BIAS = Range(-100.0, 100.0)  # each value of logit_bias
LENGTH_PENALTY = Range()

RANGES: dict[str, Range] = {
    "n": N, "best_of": BEST_OF, "temperature": TEMPERATURE, "top_p": TOP_P, "top_k": TOP_K, "seed": SEED,
    "max_tokens": MAX_TOKENS, "min_tokens": MIN_TOKENS, "logprobs": LOGPROBS, "presence_penalty": PENALTY,
    "frequency_penalty": PENALTY, "repetition_penalty": REPETITION_PENALTY, "min_p": MIN_P,
    "length_penalty": LENGTH_PENALTY,
}

# What the wire may carry beyond a request's own fields: beam search asks the engine for each beam's top
# 2W logprobs (W <= MAX_N); the engine also bounds them by its vocabulary.
WIRE_LOGPROBS = Range(0, 2 * MAX_N, integer=True)


def effective_temperature(temperature: float) -> float:
    """What a step samples with: 0 (greedy) for a temperature too small to divide logits by. Only a valid
    temperature is floored: anything else goes on as it is, for the engine to refuse."""
    return 0.0 if 0 <= temperature < MIN_TEMPERATURE else float(temperature)


def wire_temperature_ok(t) -> bool:
    """A step's temperature, once floored: 0, or a finite number >= MIN_TEMPERATURE."""
    return TEMPERATURE.admits(t) and (t == 0 or t >= MIN_TEMPERATURE)


def vocabulary_faults(vocab_size: int, top_k: int = -1, stop_token_ids=(), logit_bias_ids=()) -> list[tuple[str, str]]:
    """The rules only a model can check: (field, message) for each, in the order the fields are read."""
    faults = []
    for t in logit_bias_ids or ():
        if t >= vocab_size:
            faults.append(("logit_bias", f"token id {t} is outside the vocabulary [0, {vocab_size})"))
            break
    if top_k > vocab_size:
        faults.append(("top_k", f"{top_k} exceeds the vocabulary size {vocab_size}"))
    for t in stop_token_ids or ():
        if t >= vocab_size:
            faults.append(("stop_token_ids", f"{t} is outside the vocabulary [0, {vocab_size})"))
            break
    return faults


def check_vocabulary(vocab_size: int, top_k: int = -1, stop_token_ids=(), logit_bias_ids=()) -> None:
    faults = vocabulary_faults(vocab_size, top_k, stop_token_ids, logit_bias_ids)
    if faults:
        raise InvalidRequestError(*faults[0])


def _number(v: float) -> str:
    if isinstance(v, int) and abs(v) >= 2**20:
        sign = "-" if v < 0 else ""
        exp = math.log2(abs(v))
        if exp.is_integer():
            return f"{sign}2**{int(exp)}"
        if math.log2(abs(v) + 1).is_integer():
            return f"2**{int(math.log2(v + 1))}-1"
    return f"{v:g}" if isinstance(v, float) else str(v)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
