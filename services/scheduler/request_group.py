"""A request's samples as the scheduler holds them (its n sequences, or its beams) and what a client sees of
them at each step: RequestGroup and request_output."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from services.request.sampling_params import SamplingParams
from services.scheduler import beam_requests
from services.scheduler.beam_search import BeamSearch
from services.scheduler.lora_residency import LoraRef
from services.scheduler.request_output import CompletionOutput, RequestOutput
from services.scheduler.sequence import Sequence, SequenceStatus

Decode = Callable[[list[int], bool], str]  # token ids, skip_special_tokens -> text


@dataclass
class RequestGroup:
    """The n samples of one request."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence | None]
    stream: bool
    error: str | None = None  # why it failed, when the engine failed under this request alone
    beam: BeamSearch | None = None  # beam search: `seqs` are its live beams, the list the beams share
    next_beam_index: int = 1
    num_cached_tokens: int = 0  # beam search: prompt tokens served from the prefix cache
    lora: LoraRef | None = None  # the adapter it runs with

    @property
    def finished(self) -> bool:
        # A request that ended early (failed, aborted) before its n samples forked has no more to come.
        ended = [s for s in self.seqs if s is not None]
        return all(s.is_finished for s in ended) and (len(ended) == len(self.seqs) or ended[0].status in (
            SequenceStatus.FINISHED_ERROR, SequenceStatus.FINISHED_ABORTED))


def best_of(outs: list[CompletionOutput], n: int) -> list[CompletionOutput]:
    """The n samples of highest cumulative logprob (OpenAI's and vLLM v0's best_of), renumbered 0..n-1.
    Ties keep sample order, so the choice is deterministic."""
    ranked = sorted(outs, key=lambda o: -o.cumulative_logprob)[:n]
    for i, o in enumerate(ranked):
        o.index = i
    return ranked


def request_output(group: RequestGroup, decode: Decode) -> RequestOutput:
    """What a client sees of `group` now: finished samples whole, unfinished ones up to what can no longer
    change (stop strings held back), best_of's n best when it sampled more."""
    if group.beam is not None:
        return _beam_output(group, decode)
    outs = []
    cached = 0
    for i, seq in enumerate(group.seqs):
        if seq is None:  # a sample that never forked: it ends with its request
            outs.append(CompletionOutput(i, "", [], group.seqs[0].status.value if group.finished else None,
                                         cumulative_logprob=float("-inf")))
            continue
        if seq.detokenizer is not None:
            # Unfinished: only what can no longer turn into a stop string, so streams stay exact.
            text = seq.detokenizer.text if seq.is_finished else seq.detokenizer.visible
        elif seq.is_finished:
            text = decode(seq.output_token_ids, seq.params.skip_special_tokens)
        else:
            text = ""
        reason = seq.status.value if seq.is_finished else None
        outs.append(CompletionOutput(i, text, seq.output_token_ids, reason, seq.stop_reason, seq.logprobs,
                                     seq.cumulative_logprob))
        cached = max(cached, seq.num_cached_tokens)
    if len(outs) > group.params.n:
        outs = best_of(outs, group.params.n)
    out = RequestOutput(group.request_id, group.prompt_token_ids, outs, group.finished, max(cached, 0))
    if group.error is not None:
        out.error, out.error_kind = group.error, "request"
    return out


def _beam_output(group: RequestGroup, decode: Decode) -> RequestOutput:
    params = group.params
    outs = beam_requests.completions(group.beam, group.seqs, params,
                                     lambda ids: decode(ids, params.skip_special_tokens),
                                     group.finished)
    out = RequestOutput(group.request_id, group.prompt_token_ids, outs, group.finished, group.num_cached_tokens)
    if group.error is not None:
        out.error, out.error_kind = group.error, "request"
    return out
