"""Which drafts each step carries, and what came of them: the scheduler's half of speculative decoding.

Every step, after decodes, prefill chunks and admissions are scheduled, `Speculator.plan` picks drafts
for the decode rows (services.scheduler.spec_decode.policy decides how many the step can afford):
n-gram drafts from the sequence's own tokens, or the drafts the engine's draft model proposed after the
sequence's last step. A draft list is cut where it would overrun max_tokens or the context length, where
it crosses the min_tokens boundary (so one ban list holds for every position), before an end-of-sequence
or stop token, and where the request's grammar would refuse it. The engine verifies them against the
target; `verified` records what it kept. Drafts are never part of a sequence's tokens until the engine
returns them as committed, so prefix-cache hashes, preemption and n > 1 forks only ever see committed
tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.contracts.speculative_config import SpeculativeConfig
from services.contracts.step_protocol import EngineInfo
from services.scheduler.sequence import Sequence
from services.scheduler.spec_decode.ngram import TokenBuffer, propose_ngram
from services.scheduler.spec_decode.policy import AcceptanceRate, Candidate, StepCostModel, plan_drafts

# A sequence's acceptance estimate starts from a prior and follows its own drafts (_PRIOR_WEIGHT positions'
# worth). The prior is the replica's recent first-draft acceptance (exponentially weighted, starting at
# _INITIAL_RATE), floored at _PRIOR_FLOOR: acceptance depends on the request (a copy task accepts most
# drafts, free text few), and a prior of zero after a run of requests that reject would turn speculation
# off for good, so that no later copy task got a first draft. At the floor a new sequence still drafts
# where drafts are nearly free (a small batch: threshold ~1/knee) and not where the batch is compute-bound
# (batch 64 at a knee of ~330 tokens: threshold 0.16), which is where a drafter that never agrees (a
# random draft model: 16% of throughput at batch 64 with a fixed prior of 0.5) cost the most.
_INITIAL_RATE = 0.5
_PRIOR_FLOOR = 0.1
_PRIOR_DECAY = 0.98  # per verified draft: the replica's prior remembers about the last 50


class SpecState:
    """One sequence's speculation: its tokens for n-gram lookup, its acceptance, the engine's proposals."""

    __slots__ = ("tokens", "rate", "proposed", "proposed_at")

    def __init__(self):
        self.tokens = TokenBuffer()
        self.rate = AcceptanceRate()
        self.proposed: list[int] = []  # the draft model's proposal, valid while the sequence has proposed_at tokens
        self.proposed_at = -1


@dataclass
class SpecDecodeStats:
    """vLLM's counters: drafts verified (sequence-steps with at least one draft), draft tokens, accepted
    draft tokens, and accepted tokens per draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    knee_tokens: float = 0.0  # the step cost model's current knee

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens committed per verified draft, the target's own token included (vLLM's convention)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None


@dataclass
class StepDrafts:
    drafts: dict[str, list[int]] = field(default_factory=dict)  # seq_id -> drafts this step verifies
    propose: dict[str, int] = field(default_factory=dict)  # seq_id -> tokens the engine's drafter proposes


class Speculator:
    def __init__(self, config: SpeculativeConfig, eos_ids: frozenset[int], max_model_len: int):
        self.config = config
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self.cost = StepCostModel(pinned_knee=config.knee_tokens)
        self.stats = SpecDecodeStats(num_accepted_tokens_per_pos=[0] * config.num_speculative_tokens)
        self.replica_first_rate = _INITIAL_RATE

    @staticmethod
    def eligible(req: Sequence) -> bool:
        """Beam search ranks every beam's top candidates each step: it is never speculated."""
        return not req.params.use_beam_search

    def _limit(self, req: Sequence) -> int:
        """The most drafts `req` may carry now (max_tokens, context length, min_tokens boundary)."""
        params = req.params
        k = min(self.config.num_speculative_tokens, self.max_model_len - req.num_tokens - 1)
        if params.max_tokens is not None:
            k = min(k, params.max_tokens - req.num_output_tokens - 1)
        if req.num_output_tokens < params.min_tokens:
            k = min(k, params.min_tokens - req.num_output_tokens - 1)
        return max(k, 0)

    def _cut(self, req: Sequence, drafts: list[int]) -> list[int]:
        """Drafts up to (not including) an end token, and as far as the grammar allows."""
        params = req.params
        for i, t in enumerate(drafts):
            if (t in self.eos_ids and not params.ignore_eos) or t in params.stop_token_ids:
                drafts = drafts[:i]
                break
        if drafts and req.guide is not None:
            drafts = drafts[:req.guide.valid_prefix(drafts)]
        return drafts

    def plan(self, rows: list[tuple[Sequence, int]], step_tokens: int, budget: int, num_running: int) -> StepDrafts:
        """Drafts for this step's rows (scheduled (sequence, tokens) pairs, decodes among them)."""
        out = StepDrafts()
        cfg = self.config
        if budget <= 0 or (cfg.disable_by_batch_size is not None and num_running > cfg.disable_by_batch_size):
            return out
        knee = self.cost.knee
        prior = self.prior()
        threshold = step_tokens / (knee + step_tokens)
        candidates: list[Candidate] = []
        proposals: dict[str, list[int]] = {}
        for req, n in rows:
            state = req.drafting
            if state is None or req.num_tokens - req.num_computed_tokens != n:
                continue  # a prefill chunk that does not end the prompt samples nothing
            accept = state.rate.rate(prior)
            if accept <= threshold:
                continue  # not even its first draft is worth it in a step this large
            limit = self._limit(req)
            if limit <= 0:
                continue
            if cfg.proposer_in_engine:
                if not req.forked:
                    continue  # the step that forks n > 1 samples proposes for none of them
                # Verified now: what the drafter proposed after the sequence's last step; proposed after
                # this step: as many as the plan gives (the row is a candidate even without drafts now).
                if n == 1 and state.proposed_at == req.num_tokens:
                    proposals[req.seq_id] = self._cut(req, state.proposed[:limit])
                candidates.append(Candidate(req, limit, accept, state.rate.then_rate(_INITIAL_RATE)))
                continue
            if n != 1:
                continue
            drafts = self._cut(req, propose_ngram(state.tokens.sync(req.token_ids), cfg.prompt_lookup_min,
                                                  cfg.prompt_lookup_max, limit))
            if drafts:
                proposals[req.seq_id] = drafts
                candidates.append(Candidate(req, len(drafts), accept, state.rate.then_rate(_INITIAL_RATE)))
        if not candidates:
            return out
        for req, k in plan_drafts(candidates, step_tokens, budget, knee).items():
            drafts = proposals.get(req.seq_id, [])[:k]
            if drafts:
                out.drafts[req.seq_id] = drafts
            if cfg.proposer_in_engine:
                out.propose[req.seq_id] = k
        return out

    def prior(self) -> float:
        """A new sequence's first-draft acceptance prior: the replica's recent rate, at least _PRIOR_FLOOR."""
        return max(_PRIOR_FLOOR, self.replica_first_rate)

    def verified(self, req: Sequence, num_drafts: int, num_accepted: int) -> None:
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += num_drafts
        s.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            s.num_accepted_tokens_per_pos[i] += 1
        if num_drafts:
            hit = 1.0 if num_accepted else 0.0
            self.replica_first_rate = _PRIOR_DECAY * self.replica_first_rate + (1 - _PRIOR_DECAY) * hit
        if req.drafting is not None:
            req.drafting.rate.observe(num_drafts, num_accepted)

    def proposed(self, req: Sequence, drafts: list[int]) -> None:
        """The engine's drafter proposed `drafts` to follow `req`'s tokens as they are now."""
        if req.drafting is not None:
            req.drafting.proposed = list(drafts)
            req.drafting.proposed_at = req.num_tokens

    def observe_step(self, tokens: int, seconds: float) -> None:
        self.cost.observe(tokens, seconds)

    def snapshot(self) -> SpecDecodeStats:
        s = self.stats
        return SpecDecodeStats(s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens,
                               list(s.num_accepted_tokens_per_pos), self.cost.knee)


def speculator_for(config: SpeculativeConfig | None, info: EngineInfo, kv, max_model_len: int) -> Speculator | None:
    """The scheduler's half of speculative decoding for this engine (`info`) and KV cache manager; a drafter
    in the engine must be the one configured. ValueError naming what does not fit."""
    if config is None:
        if info.draft_method:
            raise ValueError(f"the engine runs a {info.draft_method} drafter but this scheduler has no "
                             f"speculative config: give both the same --speculative-config")
        return None
    if not getattr(kv, "supports_sharing", False) or not hasattr(kv, "trim"):
        raise ValueError("speculative decoding needs the paged KV cache (serving system pagedserve)")
    if len(info.kv_group_windows) > 1:
        # Rejected drafts are trimmed from one block table; sliding-window groups' tables are not.
        raise ValueError(f"speculative decoding is not implemented for models with sliding-window layers (this "
                         f"model's KV groups have windows {info.kv_group_windows}): start without "
                         "--speculative-config")
    if config.proposer_in_engine and (info.draft_method != config.method
                                      or info.max_draft_tokens < config.num_speculative_tokens):
        raise ValueError(f"speculative_config.method {config.method!r} with {config.num_speculative_tokens} "
                         f"tokens needs an engine started with the same config; this engine runs "
                         f"{info.draft_method or 'no drafter'} ({info.max_draft_tokens} tokens)")
    if not config.proposer_in_engine and info.draft_method:
        raise ValueError(f"the engine runs a {info.draft_method} drafter but the scheduler's method is "
                         f"{config.method!r}: give both the same --speculative-config")
    return Speculator(config, frozenset(info.eos_token_ids), max_model_len)
