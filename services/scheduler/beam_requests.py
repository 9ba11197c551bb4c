"""A beam-search request inside the engine core: its admission check and set-up, how one decision of
services.scheduler.beam_search becomes sequences (a beam continues, branches into a new sequence that
shares every block so far, copy-on-write at the first write, or is dropped and its blocks freed at once),
and what it reports. The live beams of a request are one list that every one of them holds
(`Sequence.beam_group`), so the scheduler preempts and readmits them together.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from services.request.errors import InvalidRequestError
from services.request.sampling_params import SamplingParams
from services.scheduler.beam_search import BeamCandidates, BeamSearch
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request_output import CompletionOutput
from services.scheduler.scheduler import Scheduler
from services.scheduler.sequence import Sequence, SequenceStatus


def check_capacity(prompt_len: int, params: SamplingParams, max_model_len: int, block_size: int,
                   usable_blocks: int, max_num_seqs: int) -> None:
    """The beams must fit together even unshared (after a preemption only full blocks are shared again,
    through the prefix cache), else the request could wait forever for its own beams."""
    width = params.n
    if width > max_num_seqs:
        raise InvalidRequestError("n", f"{width} beams exceed max_num_seqs={max_num_seqs}")
    longest = max_model_len if params.max_tokens is None else min(max_model_len, prompt_len + params.max_tokens)
    need = width * ((longest + block_size - 1) // block_size)
    if need > usable_blocks:
        raise InvalidRequestError("max_tokens", f"{width} beams of up to {longest} tokens need {need} KV blocks; "
                                  f"this replica has {usable_blocks}: ask for fewer tokens or beams")


def start(req: Sequence, eos_ids: frozenset[int], max_model_len: int) -> BeamSearch:
    """The search of `req`'s request; `req` becomes its first beam."""
    params = req.params
    ends = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
    room = max_model_len - req.num_prompt_tokens
    search = BeamSearch(params.n, frozenset(ends), room if params.max_tokens is None else min(params.max_tokens, room),
                        params.length_penalty, params.early_stopping, params.logprobs or 0)
    req.beam_group = [req]
    # The engine returns the top K of every beam's next token (log_softmax of the raw logits, float32).
    req.spec = replace(req.spec, logprobs=max(search.num_candidates, params.logprobs or 0))
    return search


def ready(live: list[Sequence]) -> bool:
    """Every live beam has its next-token candidates: the search can take its next step."""
    return all(s.beam_candidates is not None for s in live)


def advance(search: BeamSearch, group: list[Sequence], kv: KVCacheManager, scheduler: Scheduler,
            branch: Callable[[Sequence], Sequence]) -> int:
    """One step of the search applied to the live beams `group` (their shared list, updated in place);
    `branch(parent)` makes a new sequence continuing `parent`. Returns the tokens the beams gained."""
    live = list(group)
    cands = [BeamCandidates(s.cumulative_logprob, s.beam_candidates) for s in live]
    conts = search.step(cands, live[0].num_output_tokens, [(s.output_token_ids, s.logprobs) for s in live])
    nxt: list[Sequence | None] = [None] * len(conts)
    first: dict[int, int] = {}
    for j, c in enumerate(conts):
        if c.parent in first:  # chosen again: a new beam holding the parent's blocks (copy-on-write)
            child = branch(live[c.parent])
            kv.fork(live[c.parent], child)
            scheduler.running.append(child)
            nxt[j] = child
        else:
            first[c.parent] = j
    for parent, j in first.items():
        nxt[j] = live[parent]  # after the branches: they copied its tokens before this one's new token
    for seq, c in zip(nxt, conts, strict=True):
        seq.token_ids.append(c.token)
        seq.cumulative_logprob = c.cum_logprob
        if seq.logprobs is not None:
            seq.logprobs.append(search.chosen(cands[c.parent].top, c.logprob))
    for i, seq in enumerate(live):
        seq.beam_candidates = None
        if i not in first:  # not continued: its blocks go back now
            scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
    group[:] = nxt
    return len(conts)


def completions(search: BeamSearch, live: list[Sequence], params: SamplingParams,
                decode: Callable[[list[int]], str], request_finished: bool) -> list[CompletionOutput]:
    """The best finished beams, best first; until the search is done (or when it was cut short), the live
    beams as they stand. Always `n` entries."""
    outs = []
    for h in search.finished if search.done else []:
        stop_reason = h.token_ids[-1] if h.ended and h.token_ids[-1] in params.stop_token_ids else None
        outs.append(CompletionOutput(len(outs), decode(h.token_ids), h.token_ids, "stop" if h.ended else "length",
                                     stop_reason, h.logprobs, cumulative_logprob=h.cum_logprob))
    for seq in live:
        if len(outs) < params.n:
            reason = seq.status.value if seq.is_finished else None
            outs.append(CompletionOutput(len(outs), "", seq.output_token_ids, reason, None, seq.logprobs,
                                         cumulative_logprob=seq.cumulative_logprob))
    while len(outs) < params.n:
        outs.append(CompletionOutput(len(outs), "", [], "abort" if request_finished else None))
    return outs
