"""What callers get back for a request: one entry per sample, cumulative, until `finished`."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.contracts.step_protocol import TokenLogprobs
from services.scheduler.spec_decode.speculator import SpecDecodeStats


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float = 0.0  # of the sampled tokens, where they were computed (best_of, logprobs, beam search)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None  # set when the engine failed under this request
    # "request": the failure was this request's alone (not retried elsewhere, the replica stays healthy);
    # "engine": the engine failed under every request in flight.
    error_kind: str | None = None


@dataclass
class GuidedStats:
    """Structured output since start: compiles, the grammar cache, mask time, and constrained rows."""

    compiles: int = 0
    compile_seconds: float = 0.0
    cache_hits: int = 0
    compile_failures: int = 0
    mask_steps: int = 0  # steps with at least one constrained row
    mask_seconds: float = 0.0  # spent computing their masks
    constrained_rows: int = 0  # sampled rows that carried a mask
    sampled_rows: int = 0  # every sampled row


@dataclass
class SchedulerStats:
    num_waiting: int
    num_running: int
    kv_usage: float
    num_kv_blocks: int
    prefix_queries: int  # tokens looked up in the prefix cache
    prefix_hits: int  # tokens found there
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    guided: GuidedStats = field(default_factory=GuidedStats)
    max_loras: int = 0
    running_loras: tuple[str, ...] = ()  # names of the LoRA adapters of running requests
    waiting_loras: tuple[str, ...] = ()
    spec_decode: SpecDecodeStats | None = None  # None: no speculative decoding
    expert_tokens: tuple[int, ...] = ()  # a mixture-of-experts model: tokens routed to each expert (all layers)
