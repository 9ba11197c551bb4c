"""The reference configuration the default-path guard measures the scheduler against: the least a
continuous-batching scheduler does per step on a trace.

Same policy as services/scheduler/scheduler.py (running decodes first, then mid-prefill prompts, then
waiting requests first come first served, all under one token budget; prefix reuse of computed full
blocks by chained hash, a request whose next block another request is computing waiting up to
MAX_PREFIX_DEFERRALS steps), but nothing else: no KV pool, no block tables, no outputs, no engine.
Its step count, scheduled tokens and prefix-hit tokens are what the real scheduler should reach on the
same trace; its CPU time per step is the yardstick, measured in the same process and the same run, that
makes the real scheduler's CPU time per step comparable across machines and loads.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.bench.offline.workloads import BenchRequest
from services.scheduler.scheduler import MAX_PREFIX_DEFERRALS


@dataclass
class TraceCounts:
    """What a run over a trace scheduled (the same fields for the real scheduler and the reference)."""

    steps: int = 0
    scheduled_tokens: int = 0
    prefix_hit_tokens: int = 0
    output_tokens: int = 0


class _Req:
    __slots__ = ("tokens", "prompt_len", "out_len", "computed", "hashes", "deferrals")

    def __init__(self, r: BenchRequest):
        self.tokens = list(r.prompt_token_ids)
        self.prompt_len = len(self.tokens)
        self.out_len = r.output_len
        self.computed = 0
        self.hashes: list[int] = []
        self.deferrals = 0


def _hash_prompt(req: _Req, block_size: int) -> None:
    parent = 0
    toks = req.tokens
    for i in range(req.prompt_len // block_size):
        parent = hash((parent, tuple(toks[i * block_size:(i + 1) * block_size])))
        req.hashes.append(parent)


class ReferenceScheduler:
    """Steps through a trace like the real scheduler, one `step()` per forward pass (every output token
    'sampled' at once); `counts` says what it scheduled so far."""

    def __init__(self, trace: list[BenchRequest], max_num_batched_tokens: int, max_num_seqs: int,
                 block_size: int = 16):
        self.budget, self.max_num_seqs, self.block_size = max_num_batched_tokens, max_num_seqs, block_size
        self.counts = TraceCounts()
        self.waiting = [_Req(r) for r in trace]
        self.waiting.reverse()  # pop() from the end: the head of the queue is waiting[-1]
        self.running: list[_Req] = []
        self.computed_blocks: set[int] = set()

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> None:
        block_size, counts, waiting, running = self.block_size, self.counts, self.waiting, self.running
        computed_blocks = self.computed_blocks
        budget = self.budget
        scheduled: list[tuple[_Req, int]] = []
        for req in running:
            if budget <= 0:
                break
            if len(req.tokens) - req.computed == 1:
                scheduled.append((req, 1))
                budget -= 1
        for req in running:
            if budget <= 0:
                break
            remaining = len(req.tokens) - req.computed
            if remaining > 1:
                n = min(remaining, budget)
                scheduled.append((req, n))
                budget -= n
        pending: set[int] = set()
        for req in running:
            if req.computed < req.prompt_len:
                pending.update(req.hashes[req.computed // block_size:])
        deferred: list[_Req] = []
        while waiting and budget > 0 and len(running) < self.max_num_seqs:
            req = waiting[-1]
            if not req.hashes:
                _hash_prompt(req, block_size)
            max_blocks = (len(req.tokens) - 1) // block_size
            hit = 0
            while hit < max_blocks and req.hashes[hit] in computed_blocks:
                hit += 1
            if hit < len(req.hashes) and req.hashes[hit] in pending and req.deferrals < MAX_PREFIX_DEFERRALS:
                req.deferrals += 1
                deferred.append(waiting.pop())
                continue
            waiting.pop()
            req.computed = hit * block_size
            counts.prefix_hit_tokens += req.computed
            n = min(len(req.tokens) - req.computed, budget)
            running.append(req)
            scheduled.append((req, n))
            budget -= n
            pending.update(req.hashes[hit:])
        waiting.extend(reversed(deferred))
        counts.steps += 1
        finished = False
        for req, n in scheduled:
            counts.scheduled_tokens += n
            before = req.computed
            req.computed += n
            if before < req.prompt_len:
                computed_blocks.update(req.hashes[before // block_size:min(req.computed, req.prompt_len) // block_size])
            if req.computed == len(req.tokens):
                req.tokens.append(0)
                counts.output_tokens += 1
                if len(req.tokens) - req.prompt_len >= req.out_len:
                    finished = True
        if finished:
            self.running = [r for r in running if len(r.tokens) - r.prompt_len < r.out_len]


def run_reference(trace: list[BenchRequest], max_num_batched_tokens: int, max_num_seqs: int,
                  block_size: int = 16) -> TraceCounts:
    """Schedule `trace` to completion; returns the counts."""
    ref = ReferenceScheduler(trace, max_num_batched_tokens, max_num_seqs, block_size)
    while ref.has_unfinished():
        ref.step()
    return ref.counts
