"""One sequence being served, and the explicit state machine it moves through.

A request with `n > 1` starts as one sequence; when its prompt is done it forks into `n` sequences that
share the prompt's KV blocks (copy-on-write). Each sequence is scheduled on its own. A beam-search
request starts as one sequence too; each step its beams branch (a beam chosen twice becomes two
sequences sharing every block so far) or are dropped (services.scheduler.beam_search decides).
"""

from __future__ import annotations

import enum

from services.contracts.step_protocol import PenaltySpec, SamplingSpec
from services.request.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH, SequenceStatus.FINISHED_ABORTED,
             SequenceStatus.FINISHED_ERROR}
_ALLOWED = {
    SequenceStatus.WAITING: {SequenceStatus.RUNNING} | _FINISHED,
    SequenceStatus.RUNNING: {SequenceStatus.PREEMPTED} | _FINISHED,
    SequenceStatus.PREEMPTED: {SequenceStatus.RUNNING} | _FINISHED,
}


class Sequence:
    """A sequence: its tokens, how many of them sit in the KV cache, and where it is in its life."""

    __slots__ = ("request_id", "seq_id", "sample_index", "params", "spec", "token_ids", "num_prompt_tokens",
                 "num_computed_tokens", "status", "arrival", "stop_reason", "num_cached_tokens", "block_hashes",
                 "logprobs", "forked", "detokenizer", "num_preemptions", "num_deferrals", "min_tokens_banned",
                 "hash_root", "guide", "penalties", "cumulative_logprob", "beam_candidates", "beam_group", "lora",
                 "num_lora_waits", "drafting")

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, arrival: int,
                 sample_index: int = 0):
        self.request_id = request_id
        self.sample_index = sample_index
        self.seq_id = request_id if sample_index == 0 else f"{request_id}#{sample_index}"
        self.params = params
        # best_of > n ranks its samples by cumulative logprob: the engine must return the sampled token's.
        logprobs = params.logprobs if params.logprobs is not None or params.num_sequences == params.n else 0
        self.spec = SamplingSpec(params.effective_temperature, float(params.top_p), int(params.top_k),
                                 params.seed, logprobs)
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        self.arrival = arrival
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = -1  # prefix-cache hit at first admission; -1 until admitted
        self.block_hashes: list[int] = []  # hashes of this sequence's full blocks, computed lazily
        self.logprobs: list | None = [] if params.logprobs is not None else None
        self.forked = params.num_sequences == 1 or params.use_beam_search  # True once the n samples exist
        self.detokenizer = None
        self.num_preemptions = 0
        self.num_deferrals = 0  # steps spent waiting for a shared prefix another request computes
        self.min_tokens_banned: list[int] = []  # what may not be sampled before min_tokens (set by the core)
        self.hash_root: int | None = None  # root of its block-hash chain when salted (services.contracts.block_hash)
        self.lora = None  # the LoraRef it runs with (services.scheduler.lora_residency); None: the base model
        self.num_lora_waits = 0  # steps it waited at the head of the queue for a LoRA slot
        # Beam search: the engine's top-K for its next token (until the search has used them), and the live
        # beams of its request (one list, shared by all of them); its score sums into cumulative_logprob.
        self.beam_candidates = None
        self.beam_group: list[Sequence] | None = None
        self.guide = None  # structured output: a SequenceGuide, advanced on each committed token (set by the core)
        # The request's bias/penalties/min_p without history (None: it has none); see `penalty_spec`.
        self.penalties = penalty_template(params, prompt_token_ids)
        self.cumulative_logprob = 0.0  # of the sampled tokens (ranks best_of samples)
        # Speculative decoding: its draft state (services.scheduler.spec_decode; set by the core), or None.
        self.drafting = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status in _FINISHED

    def set_status(self, new: SequenceStatus) -> None:
        if new not in _ALLOWED.get(self.status, ()):
            raise AssertionError(f"{self.seq_id}: illegal transition {self.status.name} -> {new.name}")
        self.status = new

    def penalty_spec(self) -> PenaltySpec | None:
        """This step's PenaltySpec: the request's, with the tokens generated so far when a penalty reads them."""
        p = self.penalties
        if p is None or not (p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0):
            return p
        return PenaltySpec(p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p,
                           p.bias_token_ids, p.bias_values, self.token_ids[self.num_prompt_tokens:],
                           p.prompt_token_ids)

    def _sibling(self, sample_index: int, arrival: int, num_tokens: int) -> Sequence:
        """A sequence of the same request holding this one's first `num_tokens` tokens, already computed as
        far as this one is; the caller shares the KV blocks."""
        child = Sequence(self.request_id, self.token_ids[:num_tokens], self.params, arrival, sample_index)
        child.num_prompt_tokens = self.num_prompt_tokens
        child.spec = self.spec
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.block_hashes = list(self.block_hashes)
        child.forked = True
        child.min_tokens_banned = self.min_tokens_banned
        child.hash_root = self.hash_root
        child.lora = self.lora
        # The parent's guide has not advanced past the prompt yet: the child starts from the same state.
        child.guide = self.guide.clone() if self.guide is not None else None
        child.penalties = self.penalties
        # Its own drafts and acceptance (a fresh state of the same kind).
        child.drafting = type(self.drafting)() if self.drafting is not None else None
        child.status = SequenceStatus.RUNNING
        return child

    def fork(self, sample_index: int, first_token: int, arrival: int) -> Sequence:
        """A sibling sample sharing this prompt; the caller shares the KV blocks."""
        child = self._sibling(sample_index, arrival, self.num_prompt_tokens)
        child.token_ids.append(first_token)
        return child

    def branch(self, sample_index: int, arrival: int) -> Sequence:
        """A second beam continuing from this one's tokens so far (all computed); the caller shares the blocks."""
        child = self._sibling(sample_index, arrival, self.num_tokens)
        child.cumulative_logprob = self.cumulative_logprob
        child.logprobs = None if self.logprobs is None else list(self.logprobs)
        child.beam_group = self.beam_group
        return child

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")


def penalty_template(params: SamplingParams, prompt_token_ids: list[int]) -> PenaltySpec | None:
    """The PenaltySpec a request's rows carry, less the output history (None when it asks for none).
    Greedy requests drop min_p: it never changes the argmax, and they keep the exact greedy path."""
    min_p = params.min_p if params.effective_temperature > 0 else 0.0
    if not (params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0
            or params.logit_bias or min_p):
        return None
    bias = params.logit_bias or {}
    prompt = sorted(set(prompt_token_ids)) if params.repetition_penalty != 1.0 else []
    return PenaltySpec(float(params.presence_penalty), float(params.frequency_penalty),
                       float(params.repetition_penalty), float(min_p), list(bias), [float(b) for b in bias.values()],
                       [], prompt)
