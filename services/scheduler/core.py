"""The continuous-batching loop of one replica: validate, schedule, execute, apply results, report.

Owns the scheduler, the KV bookkeeping and per-request output state; reaches the engine only through
an Executor and the typed SchedulerOutput/ModelRunnerOutput. No torch here.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from functools import partial

from services.contracts.block_hash import adapter_seed, model_hash_seed, salted_seed
from services.contracts.speculative_config import SpeculativeConfig
from services.contracts.step_protocol import (
    EngineUnavailableError,
    ModelRunnerOutput,
    SamplingSpec,
    ScheduledSequence,
    SchedulerOutput,
)
from services.request.errors import InvalidRequestError
from services.request.limits import check_vocabulary
from services.request.sampling_params import SamplingParams
from services.scheduler import beam_requests
from services.scheduler.block_pool import KVEvent
from services.scheduler.detokenizer import IncrementalDetokenizer
from services.scheduler.executor import Executor
from services.scheduler.lora_registry import LoraRegistry
from services.scheduler.lora_residency import LoraRef
from services.scheduler.request_group import RequestGroup, request_output
from services.scheduler.request_output import GuidedStats, RequestOutput, SchedulerStats
from services.scheduler.scheduler import Scheduler, SchedulerConfig
from services.scheduler.sequence import Sequence, SequenceStatus
from services.scheduler.serving_system import serving_system as get_serving_system
from services.scheduler.spec_decode.speculator import SpecState, speculator_for
from services.scheduler.step_isolation import execute_isolating
from services.structured_output.compiler import CompiledGrammar, GrammarCompiler
from services.structured_output.guide import bitmask_bytes, compute_bitmasks

log = logging.getLogger(__name__)


def _lora_names(seqs) -> tuple[str, ...]:
    return tuple(sorted({s.lora.name for s in seqs if s.lora is not None}))


class SchedulerCore:
    def __init__(self, executor: Executor, tokenizer, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048, enable_prefix_caching: bool = True,
                 max_model_len: int | None = None, collect_kv_events: bool = False,
                 serving_system: str = "pagedserve", speculative_config: SpeculativeConfig | dict | str | None = None):
        self.executor = executor
        self.info = executor.handshake()
        self.tokenizer = tokenizer
        self.max_model_len = min(max_model_len or self.info.max_model_len, self.info.max_model_len)
        self.hash_seed = model_hash_seed(self.info.model_id, self.info.block_size)
        # A deque: the loop thread appends while the registry publisher drains from another thread, and
        # deque.append / popleft are atomic, so no event is lost between the two.
        self._events: deque[KVEvent] | None = deque() if collect_kv_events else None
        # pagedserve, or one of the papers' baselines (services.scheduler.serving_system).
        self.system = system = get_serving_system(serving_system)
        self.pool, self.kv = system.build_kv(
            self.info.num_kv_blocks, self.info.block_size, self.hash_seed, self.max_model_len,
            enable_prefix_caching, self._record_event if self._events is not None else None,
            [w or None for w in self.info.kv_group_windows])
        self.speculator = speculator_for(SpeculativeConfig.parse(speculative_config), self.info, self.kv,
                                         self.max_model_len)
        self.scheduler = Scheduler(SchedulerConfig(max_num_seqs, max_num_batched_tokens, self.max_model_len,
                                                   system.batching, self.info.max_loras), self.kv, self.speculator)
        self.loras = LoraRegistry(executor, self.scheduler.loras)
        self.eos_ids = frozenset(self.info.eos_token_ids)
        self.groups: dict[str, RequestGroup] = {}
        self._arrival = itertools.count()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.last_output: SchedulerOutput | None = None
        # Structured output: grammars compile on the compiler's threads (read the tokenizer on first use);
        # each constrained row's mask is computed here, between steps, from its committed tokens.
        self.grammars = GrammarCompiler(lambda: tokenizer.fast.to_str(), self.info.vocab_size,
                                        self.info.eos_token_ids)
        self._mask_bytes = bitmask_bytes(self.info.vocab_size)
        self.mask_seconds = 0.0  # spent computing masks, over every step that had a constrained row
        self.mask_steps = 0
        self.constrained_rows = 0
        self.sampled_rows = 0
        self.expert_tokens: list[int] = []  # a mixture-of-experts engine's tokens per expert, since start

    # -- requests ---------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """What this model and KV cache can serve. SamplingParams checked their own ranges when built."""
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("prompt", "must not be empty")
        vocab = self.info.vocab_size
        for t in prompt_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise InvalidRequestError("prompt", f"token id {t!r} is outside the vocabulary [0, {vocab})")
        if n >= self.max_model_len:
            raise InvalidRequestError(
                "prompt", f"{n} tokens leave no room to generate within the context length {self.max_model_len}")
        usable = self.info.num_kv_blocks - self.kv.watermark_blocks
        need = self.kv.peak_blocks(n + 1, self.scheduler.config.max_num_batched_tokens)
        if need > usable:
            if len(self.info.kv_group_windows) == 1 and not self.info.kv_group_windows[0]:
                raise InvalidRequestError("prompt", f"{n} tokens exceed the KV cache capacity of "
                                                    f"{usable * self.info.block_size} tokens")
            raise InvalidRequestError("prompt", f"{n} tokens need {need} KV blocks at once (every KV group "
                                                f"counted); the cache has {usable}")
        self.kv.check_request(n, params)
        check_vocabulary(vocab, params.top_k, params.stop_token_ids, params.logit_bias)
        if params.use_beam_search:
            beam_requests.check_capacity(n, params, self.max_model_len, self.info.block_size,
                                         self.info.num_kv_blocks - self.kv.watermark_blocks,
                                         self.scheduler.config.max_num_seqs)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    stream: bool = False, validated: bool = False, grammar: CompiledGrammar | None = None,
                    lora_name: str | None = None) -> None:
        """Queue a request; `validated` when the caller already ran `validate` on it; `grammar`: its
        structured_outputs compiled (else compiled here, blocking: callers with a step loop compile first);
        `lora_name`: the loaded adapter it runs with (resolved here, on the loop thread, so a load or unload
        racing the request either precedes it or follows it), whose digest roots its block-hash chain."""
        if request_id in self.groups:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in flight")
        if not validated:
            self.validate(prompt_token_ids, params)
        if params.structured_outputs is not None and grammar is None:
            grammar = self.grammars.compile(params.structured_outputs)
        req = Sequence(request_id, prompt_token_ids, params, next(self._arrival))
        if self.speculator is not None and self.speculator.eligible(req):
            req.drafting = SpecState()
        if grammar is not None:
            req.guide = grammar.new_guide()
        root, lora = self.hash_seed, None
        if lora_name is not None:
            lora = self.loras.get(lora_name)
            if lora is None:
                raise InvalidRequestError("model", f"the LoRA adapter {lora_name!r} is not loaded here")
            req.lora = lora
            root = adapter_seed(root, lora.digest)
        if params.cache_salt or lora is not None:
            req.hash_root = salted_seed(root, params.cache_salt)
        if params.min_tokens:
            # Masked out of sampling until min_tokens are out, so the request cannot end early at all.
            ends = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_ids))
            req.min_tokens_banned = sorted(ends)
        samples = [req] + [None] * (params.num_sequences - 1)
        group = RequestGroup(request_id, list(prompt_token_ids), params, samples, stream, lora=lora)
        if params.use_beam_search:
            group.beam = beam_requests.start(req, self.eos_ids, self.max_model_len)
            group.seqs = req.beam_group
        elif stream or params.stop_strings:
            self._attach_detokenizer(req)
        self.groups[request_id] = group
        self.prompt_tokens += len(prompt_token_ids)
        self.scheduler.add(req)

    def load_lora(self, name: str, path: str) -> LoraRef:
        """Load (or reload) adapter `name` from `path`; AdapterError when it is bad."""
        return self.loras.load(name, path)

    def unload_lora(self, name: str) -> LoraRef:
        """Unload adapter `name`: new requests cannot name it; those in flight finish with it."""
        ref = self.loras.unload(name)
        self.loras.release_unused(g.lora.digest for g in self.groups.values() if g.lora is not None)
        return ref

    def _attach_detokenizer(self, req: Sequence, replay: bool = True) -> None:
        req.detokenizer = IncrementalDetokenizer(
            self.tokenizer.fast, req.token_ids[:req.num_prompt_tokens], req.params.stop_strings,
            req.params.include_stop_str_in_output, req.params.skip_special_tokens, req.params.min_tokens)
        if replay:
            for t in req.output_token_ids:
                req.detokenizer.add(t)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        group = self.groups.pop(request_id, None)
        if group is None:
            return None
        for seq in group.seqs:
            if seq is not None:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
        return request_output(group, self._decode)

    def fail_all(self, message: str) -> list[RequestOutput]:
        """The engine broke: end every request with an error and return all blocks to the pool."""
        outs = []
        for group in list(self.groups.values()):
            for seq in group.seqs:
                if seq is not None:
                    self.scheduler.finish(seq, SequenceStatus.FINISHED_ERROR)
            out = request_output(group, self._decode)
            out.error, out.error_kind = message, "engine"
            outs.append(out)
        self.groups.clear()
        self.pool.reset_cache()  # the engine's KV tensors may be gone with it
        return outs

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- one iteration ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler
        out = sched.schedule()
        self.last_output = out
        changed: dict[str, RequestGroup] = {}
        for req in sched.rejected:
            changed[req.request_id] = self.groups[req.request_id]
        sched.rejected.clear()
        if out.sequences:
            self._constrain(out, changed)
        if out.sequences:
            # A failure tied to some sequences fails only their requests; EngineUnavailableError (the
            # engine itself is gone) propagates, and the caller fails everything.
            start = time.perf_counter()
            step = execute_isolating(self.executor, out, self._canary_ok)
            if self.speculator is not None and not step.failed:
                self.speculator.observe_step(out.num_tokens, time.perf_counter() - start)
            for seq_id, why in step.failed.items():
                self._fail_request_of(seq_id, why, changed)
            self._apply(step.result, changed)
        outputs = []
        for rid, group in changed.items():
            if group.finished:
                del self.groups[rid]
                outputs.append(request_output(group, self._decode))
            elif group.stream:
                outputs.append(request_output(group, self._decode))
        self.loras.release_unused(g.lora.digest for g in self.groups.values() if g.lora is not None)
        return outputs

    def _constrain(self, out: SchedulerOutput, changed: dict[str, RequestGroup]) -> None:
        """Attach each constrained row's token mask. A guide that fails here (past its fuel limit) fails its
        request, and its sequence leaves the step before the engine sees it."""
        sched = self.scheduler
        rows = constrained = 0
        wanted: list[tuple[Sequence, ScheduledSequence]] = []
        drafted: list[tuple[Sequence, ScheduledSequence]] = []  # rows with drafts: a mask per position
        for (req, _), s in zip(sched.last_scheduled, out.sequences, strict=True):
            if s.sample:
                positions = s.num_samples + s.num_draft_tokens
                rows += positions
                if req.guide is not None:
                    constrained += positions
                    (drafted if s.num_draft_tokens else wanted).append((req, s))
        self.sampled_rows += rows
        if not wanted and not drafted:
            return
        start = time.perf_counter()
        for req, s in drafted:  # the scheduler cut the drafts where the grammar refuses them
            s.token_bitmask = b"".join(req.guide.bitmasks_along(s.token_ids[-s.num_draft_tokens:], self._mask_bytes))
        masks = compute_bitmasks([req.guide for req, _ in wanted], self._mask_bytes) if wanted else []
        self.constrained_rows += constrained
        self.mask_seconds += time.perf_counter() - start
        self.mask_steps += 1
        dead = [req for req, _ in drafted if req.guide.error is not None]
        for (req, s), mask in zip(wanted, masks, strict=True):
            s.token_bitmask = mask
            if req.guide.error is not None:
                dead.append(req)
        for req in dead:
            self._fail_group(self.groups[req.request_id], f"structured output: {req.guide.error}", changed)
        if dead:
            gone = {req.seq_id for req in dead}
            out.sequences = [s for s in out.sequences if s.seq_id not in gone]  # _apply skips them: finished

    def _canary_ok(self) -> bool:
        """Does the engine still compute? One token in a spare block, greedy: a step nothing can be wrong with."""
        groups = len(self.info.kv_group_windows)
        if self.pool.num_free < groups:
            return True  # no spare block to try with: blame the requests, which fail either way
        blocks = [self.pool.allocate(g) for g in range(groups)]  # one per KV group
        canary = ScheduledSequence(seq_id="pagedserve-canary", token_ids=[0], start_pos=0,
                                   block_table=[blocks[0].block_id], sample=True, sampling=SamplingSpec(),
                                   group_block_tables=[[b.block_id] for b in blocks[1:]])
        try:
            self.executor.execute(SchedulerOutput(step_id=-1, sequences=[canary]))
            return True
        except EngineUnavailableError:
            raise
        except Exception as exc:
            log.error("the engine fails a canary step too (%s: %s): the engine is broken", type(exc).__name__, exc)
            return False
        finally:
            for block in blocks:
                self.pool.free(block)  # never hashed: back to the free end of the queue

    def _fail_request_of(self, seq_id: str, why: str, changed: dict[str, RequestGroup]) -> None:
        seq = next(s for s, _ in self.scheduler.last_scheduled if s.seq_id == seq_id)
        self._fail_group(self.groups[seq.request_id], f"the engine failed on this request: {why}", changed)

    def _fail_group(self, group: RequestGroup, why: str, changed: dict[str, RequestGroup]) -> None:
        """End every sample of a request with an error of its own (the rest of the batch carries on)."""
        for s in group.seqs:
            if s is not None:
                self.scheduler.finish(s, SequenceStatus.FINISHED_ERROR)
        group.error = why
        changed[group.request_id] = group

    def _apply(self, result: ModelRunnerOutput, changed: dict[str, RequestGroup]) -> None:
        sched = self.scheduler
        if result.expert_tokens:
            counts = self.expert_tokens or [0] * len(result.expert_tokens)
            self.expert_tokens = [a + b for a, b in zip(counts, result.expert_tokens, strict=True)]
        sampled = result.sampled
        logprobs = result.logprobs
        beams: dict[str, RequestGroup] = {}
        planned = sched.step_drafts
        for req, n in sched.last_scheduled:
            if req.is_finished:
                continue  # its request failed in this step; its blocks are already back in the pool
            drafts = planned.drafts.get(req.seq_id)
            if drafts is not None or req.seq_id in planned.propose:
                self._apply_speculated(req, n, drafts or [], result, changed)
                continue
            req.num_computed_tokens += n
            self.kv.commit(req)
            tokens = sampled.get(req.seq_id)
            if tokens is None:
                continue
            group = self.groups[req.request_id]
            changed[req.request_id] = group
            lps = logprobs.get(req.seq_id)
            if group.beam is not None:
                req.beam_candidates = lps[0]
                beams[group.request_id] = group
                continue
            if len(tokens) > 1:
                for j in range(1, len(tokens)):
                    child = req.fork(j, tokens[j], next(self._arrival))
                    self.kv.fork(req, child)
                    sched.running.append(child)
                    group.seqs[j] = child
                    if req.detokenizer is not None:
                        self._attach_detokenizer(child, replay=False)
                    self._on_token(child, tokens[j], lps[j] if lps else None, first_append_done=True)
            req.forked = True
            if not req.is_finished:  # a forked sample's grammar may have failed the request
                self._on_token(req, tokens[0], lps[0] if lps else None)
        for group in beams.values():
            if beam_requests.ready(group.seqs):
                group.num_cached_tokens = max([group.num_cached_tokens] + [s.num_cached_tokens for s in group.seqs])
                self.generation_tokens += beam_requests.advance(group.beam, group.seqs, self.kv, sched,
                                                                partial(self._branch, group))
                changed[group.request_id] = group

    def _apply_speculated(self, req: Sequence, n: int, drafts: list[int], result: ModelRunnerOutput,
                          changed: dict[str, RequestGroup]) -> None:
        """A row that carried drafts (or KV slots for the engine's drafter): commit the tokens the engine
        kept one at a time, exactly as that many steps without speculation would (prefix-cache blocks,
        stop conditions, grammar), then give back the blocks past the committed tokens."""
        tokens = result.sampled.get(req.seq_id)
        if tokens is None:
            req.num_computed_tokens += n  # a prefill chunk that samples nothing
            self.kv.commit(req)
            self.kv.trim(req, req.num_tokens)
            return
        if not 1 <= len(tokens) <= len(drafts) + 1 or tokens[:len(tokens) - 1] != drafts[:len(tokens) - 1]:
            raise AssertionError(f"{req.seq_id}: the engine committed {tokens} for drafts {drafts}")
        if drafts:
            self.speculator.verified(req, len(drafts), len(tokens) - 1)
        group = self.groups[req.request_id]
        changed[req.request_id] = group
        lps = result.logprobs.get(req.seq_id)
        for i, token in enumerate(tokens):
            # Position start + n - 1 + i now holds a committed token whose KV this step computed.
            req.num_computed_tokens += n if i == 0 else 1
            self.kv.commit(req)
            self._on_token(req, token, lps[i] if lps else None)
            if req.is_finished:
                return
        self.kv.trim(req, req.num_tokens)
        proposed = result.draft_token_ids.get(req.seq_id)
        if proposed is not None:
            self.speculator.proposed(req, proposed)

    def _branch(self, group: RequestGroup, parent: Sequence) -> Sequence:
        group.next_beam_index += 1
        return parent.branch(group.next_beam_index - 1, next(self._arrival))

    def _on_token(self, req: Sequence, token: int, lp, first_append_done: bool = False) -> None:
        guide = req.guide
        if guide is not None and not guide.accept(token):
            # The mask allowed nothing this token could be (e.g. min_tokens banned the only way to end):
            # the request ends with the reason, never with text the grammar refuses.
            if first_append_done:
                req.token_ids.pop()
            group = self.groups[req.request_id]
            why = guide.error or f"token {token} is not allowed by the grammar"
            self._fail_group(group, f"structured output: no allowed continuation: {why}", {})
            return
        if not first_append_done:
            req.token_ids.append(token)
        if lp is not None:
            req.cumulative_logprob += lp.logprob
            if req.logprobs is not None:
                req.logprobs.append(lp)
        self.generation_tokens += 1
        params = req.params
        stop_str = req.detokenizer.add(token) if req.detokenizer is not None else None
        n_out = req.num_output_tokens
        status = None
        if n_out >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_ids:
                status = SequenceStatus.FINISHED_STOPPED
            elif token in params.stop_token_ids:
                status, req.stop_reason = SequenceStatus.FINISHED_STOPPED, token
            elif stop_str is not None:
                status, req.stop_reason = SequenceStatus.FINISHED_STOPPED, stop_str
        if status is None and guide is not None and guide.done:
            status = SequenceStatus.FINISHED_STOPPED  # the grammar is complete: nothing more may follow
        if status is None and ((params.max_tokens is not None and n_out >= params.max_tokens)
                               or req.num_tokens >= self.max_model_len):
            status = SequenceStatus.FINISHED_LENGTH
        if status is not None:
            self.scheduler.finish(req, status)

    # -- reporting --------------------------------------------------------------------------
    def _decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens)

    def stats(self) -> SchedulerStats:
        sched = self.scheduler
        return SchedulerStats(
            num_waiting=len(sched.waiting), num_running=len(sched.running), kv_usage=self.pool.usage(),
            num_kv_blocks=self.pool.num_blocks, prefix_queries=self.kv.prefix_queries,
            prefix_hits=self.kv.prefix_hits, num_preemptions=sched.num_preemptions,
            prompt_tokens=self.prompt_tokens, generation_tokens=self.generation_tokens,
            guided=GuidedStats(self.grammars.stats.compiles, self.grammars.stats.compile_seconds,
                               self.grammars.stats.cache_hits, self.grammars.stats.failures, self.mask_steps,
                               self.mask_seconds, self.constrained_rows, self.sampled_rows),
            max_loras=self.info.max_loras, running_loras=_lora_names(sched.running),
            waiting_loras=_lora_names(sched.waiting),
            spec_decode=self.speculator.snapshot() if self.speculator is not None else None,
            expert_tokens=tuple(self.expert_tokens))

    def _record_event(self, event: KVEvent) -> None:
        self._events.append(event)

    def drain_kv_events(self) -> list[KVEvent]:
        """Events since the last call, oldest first. Safe to call from another thread."""
        events: list[KVEvent] = []
        if self._events is None:
            return events
        while True:
            try:
                events.append(self._events.popleft())
            except IndexError:
                return events
