"""Iteration-level scheduling: which sequences run in the next forward pass, and with how many tokens.

Every step: running decodes first (one token each), then running prompts that are mid-prefill, then
waiting requests in arrival order, all under a token budget (chunked prefill: a long prompt takes
what is left and continues next step, so decodes never stall behind it). When KV blocks run out the
most recently admitted sequence is preempted and later recomputed (a beam with the other beams of its
request). Waiting requests are admitted strictly first come, first served: the head of the queue is
never overtaken, so none starves.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from services.contracts.step_protocol import ScheduledSequence, SchedulerOutput
from services.scheduler.batching import Batching
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.lora_residency import LoraResidency
from services.scheduler.sequence import Sequence, SequenceStatus
from services.scheduler.spec_decode.speculator import Speculator, StepDrafts

# A request waits at most this many steps for blocks another request is computing (bounded, so FCFS
# admission never turns into starvation).
MAX_PREFIX_DEFERRALS = 8
# Steps a request may wait at the head for a LoRA slot while requests of resident adapters pass it; then
# nothing passes it, the running adapters drain, and it gets a slot.
MAX_LORA_WAITS = 32
# The group tables of a model with one KV group: shared and never written (its steps send none).
_NO_GROUP_TABLES: list[list[int]] = []


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    batching: Batching = Batching.ITERATION
    max_loras: int = 0  # distinct LoRA adapters in one step (the engine's slots); 0: none

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, speculator: Speculator | None = None):
        self.config = config
        self.speculator = speculator
        self.step_drafts = StepDrafts()  # the drafts of the last step scheduled (speculative decoding)
        # The engine's drafter is an EAGLE-3 head: a chunk that does not end its prompt carries the next token.
        self.wants_next_prompt_token = speculator is not None and speculator.config.method == "eagle3"
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._step = 0
        self._scheduled: list[tuple[Sequence, int]] = []
        self.rejected: list[Sequence] = []  # finished without running; the engine core reports them
        self.loras = LoraResidency(config.max_loras) if config.max_loras else None

    # -- queue management -------------------------------------------------------------------
    def add(self, req: Sequence) -> None:
        self.waiting.append(req)

    def finish(self, req: Sequence, status: SequenceStatus) -> None:
        """Take `req` out of whichever queue holds it and release its blocks at once."""
        if req.is_finished:
            return
        if req.status == SequenceStatus.RUNNING:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        req.set_status(status)
        self.kv.free(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        preempted = False
        admit = self.config.batching.admits(len(self.running))

        # 1. Decodes, in admission order; blocks short -> preempt the newest running sequence (with its
        #    beam group: a group's beams advance together, so they leave and come back together).
        for req in list(self.running):
            if budget <= 0:
                break
            if req.status is not SequenceStatus.RUNNING or req.num_tokens - req.num_computed_tokens != 1:
                continue
            while not self.kv.allocate_slots(req, 1):
                preempted = True
                if self._preempt(self.running[-1]):
                    # Beams of that group scheduled earlier in this step are gone too.
                    kept = [(s, n) for s, n in scheduled if s.status is SequenceStatus.RUNNING]
                    budget += len(scheduled) - len(kept)
                    scheduled = kept
                if req.status is not SequenceStatus.RUNNING:
                    break
            else:
                scheduled.append((req, 1))
                budget -= 1

        # 2. Prompts already admitted but not fully computed (chunked prefill continues).
        for req in self.running:
            if budget <= 0:
                break
            remaining = req.num_tokens - req.num_computed_tokens
            if remaining <= 1:
                continue
            n = min(remaining, budget)
            if self.kv.allocate_slots(req, n):
                scheduled.append((req, n))
                budget -= n

        # 3. Admit waiting requests, first come first served; none after a preemption this step. A request
        #    whose next prompt block another request is computing right now waits a step or two (keeping
        #    its place at the head) and then reuses those blocks instead of computing them again.
        pending = self._blocks_in_flight() if self.waiting else set()
        deferred: list[Sequence] = []
        loras = self.loras
        active = loras.active(self.running) if loras is not None else set()
        while (admit and self.waiting and budget > 0 and not preempted
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[0]
            if req.lora is not None and (loras is None or not loras.admits(req.lora, active)):
                # Its adapter has no slot this step: requests of resident adapters (and the base model) go
                # past it, until it has waited long enough that nothing does.
                if loras is None:
                    raise AssertionError(f"{req.seq_id}: a LoRA request reached a scheduler without slots")
                req.num_lora_waits += 1
                if req.num_lora_waits > MAX_LORA_WAITS or deferred and deferred[0].num_lora_waits > MAX_LORA_WAITS:
                    break
                deferred.append(self.waiting.popleft())
                continue
            cached = self.kv.find_cached_prefix(req)
            nxt = len(cached)
            if (nxt < len(req.block_hashes) and req.block_hashes[nxt] in pending
                    and req.num_deferrals < MAX_PREFIX_DEFERRALS):
                req.num_deferrals += 1
                deferred.append(self.waiting.popleft())
                continue
            num_cached = nxt * self.kv.block_size
            n = min(req.num_tokens - num_cached, budget)
            if not self.kv.allocate_slots(req, n, cached=cached, watermark=True):
                if not self.running and not scheduled:
                    self._reject_oversized(req)
                    continue
                break
            self.waiting.popleft()
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
            self.kv.record_hit(req, num_cached)
            req.num_computed_tokens = num_cached
            req.set_status(SequenceStatus.RUNNING)
            self.running.append(req)
            scheduled.append((req, n))
            budget -= n
            pending.update(req.block_hashes[nxt:])
            if req.lora is not None:
                active.add(req.lora.digest)
        self.waiting.extendleft(reversed(deferred))
        self.step_drafts = self._add_drafts(scheduled, budget) if self.speculator is not None and scheduled else (
            StepDrafts())
        if not scheduled and self.running:
            # Nothing can run: every running sequence is a beam waiting for siblings that cannot be admitted
            # while it holds its blocks (or a prompt chunk that finds none). Free the newest to break the wait.
            self._preempt(self.running[-1])

        self._scheduled = scheduled
        self._step += 1
        slots = self._lora_slots(scheduled) if loras is not None else {}
        return SchedulerOutput(
            step_id=self._step,
            sequences=[self._describe(req, n, slots) for req, n in scheduled],
            blocks_to_copy=self.kv.take_copies(),
            lora_slots=sorted((slot, d) for d, slot in slots.items()),
        )

    def _add_drafts(self, scheduled: list[tuple[Sequence, int]], budget: int) -> StepDrafts:
        """Draft tokens for this step's rows, in the budget left (services.scheduler.spec_decode), with KV
        slots for them and for what the engine's drafter writes past them; a row whose slots are short
        runs without (drafts never preempt anyone)."""
        plan = self.speculator.plan(scheduled, sum(n for _, n in scheduled), budget, len(self.running))
        for req, n in scheduled:
            drafts = plan.drafts.get(req.seq_id, ())
            ahead = plan.propose.get(req.seq_id, 0)
            if (drafts or ahead) and not self.kv.allocate_slots(req, n + len(drafts) + ahead):
                plan.drafts.pop(req.seq_id, None)
                plan.propose.pop(req.seq_id, None)
        return plan

    def _lora_slots(self, scheduled: list[tuple[Sequence, int]]) -> dict[str, int]:
        used = self.loras.active(req for req, _ in scheduled)
        return self.loras.assign(used, self.loras.active(self.running)) if used else {}

    def _describe(self, req: Sequence, n: int, slots: dict[str, int]) -> ScheduledSequence:
        start = req.num_computed_tokens
        sample = start + n == req.num_tokens
        drafts = self.step_drafts.drafts.get(req.seq_id)
        tokens = req.token_ids[start:start + n]
        return ScheduledSequence(
            seq_id=req.seq_id,
            token_ids=tokens if drafts is None else tokens + drafts,
            start_pos=start,
            block_table=self.kv.block_ids[req.seq_id],
            group_block_tables=self.kv.group_block_ids.get(req.seq_id) or _NO_GROUP_TABLES,
            sample=sample,
            sampling=req.spec,
            num_samples=req.params.num_sequences if (sample and not req.forked) else 1,
            sample_index=req.sample_index,
            output_index=req.num_output_tokens,
            banned_token_ids=req.min_tokens_banned if sample and req.num_output_tokens < req.params.min_tokens else [],
            penalties=req.penalty_spec() if sample and req.penalties is not None else None,
            lora_slot=-1 if req.lora is None else slots[req.lora.digest],
            num_draft_tokens=0 if drafts is None else len(drafts),
            propose_draft_tokens=self.step_drafts.propose.get(req.seq_id, 0),
            next_prompt_token=req.token_ids[start + n] if not sample and self.wants_next_prompt_token else -1,
        )

    def _blocks_in_flight(self) -> set[int]:
        """Hashes of the prompt blocks that running prefills have not computed yet."""
        if not self.kv.pool.enable_caching:
            return set()
        bs = self.kv.block_size
        pending: set[int] = set()
        for req in self.running:
            if req.num_computed_tokens < req.num_prompt_tokens:
                pending.update(req.block_hashes[req.num_computed_tokens // bs:])
        return pending

    def _preempt(self, req: Sequence) -> bool:
        """Back to the head of the queue, to be recomputed; a beam takes its whole group along (True)."""
        group = req.beam_group
        if group is None:
            self._preempt_one(req)
            self.waiting.appendleft(req)
            return False
        for s in group:
            if s.status is SequenceStatus.RUNNING:
                self._preempt_one(s)
            elif not s.is_finished:
                self.waiting.remove(s)
        self.waiting.extendleft(reversed(group))  # together and in order, so they are admitted together
        return True

    def _preempt_one(self, req: Sequence) -> None:
        self.running.remove(req)
        req.set_status(SequenceStatus.PREEMPTED)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.beam_candidates = None  # recomputation gives them again
        req.num_preemptions += 1
        self.num_preemptions += 1

    def _reject_oversized(self, req: Sequence) -> None:
        """Nothing runs and the head request still doesn't fit: it never will. Finish it as 'length'."""
        self.waiting.popleft()
        req.set_status(SequenceStatus.FINISHED_LENGTH)
        self.rejected.append(req)

    @property
    def last_scheduled(self) -> list[tuple[Sequence, int]]:
        return self._scheduled
