"""Synthetic steps for an engine without a scheduler: sequences with their own block tables, driven
through a ModelRunner (prefill in chunks, then decodes fed with the sampled tokens). The GPU check
measures the engine alone with it; engine tests build exact steps with it."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.contracts.step_protocol import SamplingSpec, ScheduledSequence, SchedulerOutput


def scheduled(seq_id: str, tokens: list[int], start: int, table: list[int], *, sample: bool = True,
              num_samples: int = 1, banned: list[int] | None = None, **sampling) -> ScheduledSequence:
    return ScheduledSequence(seq_id=seq_id, token_ids=list(tokens), start_pos=start, block_table=list(table),
                             sample=sample, sampling=SamplingSpec(**sampling), num_samples=num_samples,
                             banned_token_ids=list(banned or []))


@dataclass
class SyntheticSequence:
    seq_id: str
    tokens: list[int]  # prompt, then every sampled token
    table: list[int]
    computed: int = 0  # tokens whose KV is in the cache
    samples: list[int] = field(default_factory=list)
    sampling: dict = field(default_factory=dict)  # SamplingSpec fields (default: greedy)


class StepDriver:
    """Allocates blocks in order (block 0 included) and builds steps for a set of hand sequences."""

    def __init__(self, runner, first_block: int = 0):
        self.runner = runner
        self.block_size = runner.block_size
        self.next_block = first_block
        self.seqs: dict[str, SyntheticSequence] = {}
        self.step_id = 0

    def add(self, seq_id: str, prompt: list[int], **sampling) -> None:
        self.seqs[seq_id] = SyntheticSequence(seq_id, list(prompt), [], sampling=sampling)

    def _grow(self, s: SyntheticSequence, upto: int) -> None:
        while len(s.table) * self.block_size < upto:
            s.table.append(self.next_block)
            self.next_block += 1

    def prefill(self, budget: int) -> int:
        """Steps of at most `budget` prompt tokens until every prompt has sampled; returns the steps."""
        steps = 0
        while any(not s.samples for s in self.seqs.values()):
            chunks, left = {}, budget
            for s in self.seqs.values():
                chunks[s.seq_id] = n = 0 if s.samples else min(len(s.tokens) - s.computed, left)
                left -= n
            self.step(chunks)
            steps += 1
        return steps

    def step(self, chunks: dict[str, int] | None = None) -> dict[str, list[int]]:
        """One step: `chunks` gives prompt tokens to compute per sequence (default: the rest of the
        prompt, or one decode token); a sequence samples when its chunk ends at its last token."""
        seqs = []
        for s in self.seqs.values():
            remaining = len(s.tokens) - s.computed
            n = min(remaining, (chunks or {}).get(s.seq_id, remaining))
            if n <= 0:
                continue
            self._grow(s, s.computed + n)
            seq = scheduled(s.seq_id, s.tokens[s.computed:s.computed + n], s.computed, s.table,
                            sample=s.computed + n == len(s.tokens), **s.sampling)
            seq.output_index = len(s.samples)  # a seeded sequence draws afresh at each token
            seqs.append(seq)
        self.step_id += 1
        sampled = self.execute(SchedulerOutput(self.step_id, seqs))
        for seq in seqs:
            s = self.seqs[seq.seq_id]
            s.computed += len(seq.token_ids)
            if seq.seq_id in sampled:
                s.tokens += sampled[seq.seq_id]
                s.samples += sampled[seq.seq_id]
        return sampled

    def execute(self, out: SchedulerOutput) -> dict[str, list[int]]:
        return self.runner.execute(out).sampled
