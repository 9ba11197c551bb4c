"""Beam search in the offline API, shaped like vLLM's: `LLM.beam_search(prompts, BeamSearchParams(...))`
returns one `BeamSearchOutput` per prompt whose `sequences` are the best `beam_width` beams, best first.

The search runs inside the scheduler (services.scheduler.beam_search): its beams share KV blocks and are
batched with every other request. Scores follow transformers (see that module for the conventions).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.contracts.step_protocol import TokenLogprobs
from services.request.errors import InvalidRequestError
from services.request.sampling_params import SamplingParams


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # vLLM's field; beam search ranks beams by logprob, so only 0 is accepted
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # vLLM's field; beam search stops at tokens, never strings
    early_stopping: bool | str = False  # transformers' semantics: True, False or "never"

    def __post_init__(self) -> None:
        self.to_sampling_params()  # validate now, naming the field

    def to_sampling_params(self) -> SamplingParams:
        if not isinstance(self.beam_width, int) or isinstance(self.beam_width, bool) or self.beam_width < 1:
            raise InvalidRequestError("beam_width", f"must be a positive integer, got {self.beam_width!r}")
        try:
            return SamplingParams(n=self.beam_width, temperature=self.temperature, max_tokens=self.max_tokens,
                                  ignore_eos=self.ignore_eos, use_beam_search=True,
                                  length_penalty=self.length_penalty, early_stopping=self.early_stopping,
                                  include_stop_str_in_output=self.include_stop_str_in_output)
        except InvalidRequestError as exc:
            raise InvalidRequestError("beam_width" if exc.field == "n" else exc.field, exc.message) from None


@dataclass
class BeamSearchSequence:
    """One finished beam. `tokens` include the prompt, as in vLLM; so does `text`."""

    tokens: list[int]
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (an end token) or "length"
    stop_reason: int | str | None = None
    output_token_ids: list[int] = field(default_factory=list)  # the generated part of `tokens`
    output_text: str = ""  # the generated part of `text`


@dataclass
class BeamSearchOutput:
    """The best `beam_width` beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]
