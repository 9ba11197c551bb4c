"""The step protocol: the one interface between the scheduler process and the engine process.

`SchedulerOutput` is all the engine ever sees of the scheduler; `ModelRunnerOutput` is all it returns;
`EngineInfo` is the engine's handshake. Plain dataclasses of ints, floats and lists with their wire form
(`to_wire`/`from_wire`, msgpack-ready dicts), so they cross a process boundary as they are. This module
imports neither side: the engine never imports the scheduler, and the scheduler never imports the engine.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


def _fields(obj) -> dict:
    """A flat dataclass's fields as a dict, its lists shared rather than copied: msgpack reads them as
    they are. (dataclasses.asdict deep-copies everything: ~30 us per scheduled sequence, most of the
    scheduler's side of a decode step.)"""
    return {name: getattr(obj, name) for name in obj.__dataclass_fields__}


@dataclass(slots=True)
class SamplingSpec:
    """What the engine needs to draw a token; validation happened in SamplingParams."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    logprobs: int | None = None


@dataclass(slots=True)
class PenaltySpec:
    """The rarer logits processors of one row (services/engine/logits_processors.py): vLLM's penalties,
    OpenAI's logit_bias and min_p. A row that uses none has no PenaltySpec, so nothing of it goes on the
    wire. The token history comes with every step from the scheduler (its copy is the truth), so
    preemption, re-runs of a step and forks of n > 1 can never leave the engine with a stale one."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    bias_token_ids: list[int] = field(default_factory=list)  # logit_bias, as two parallel lists
    bias_values: list[float] = field(default_factory=list)
    # Tokens generated so far (with repeats: frequency counts them); empty unless a penalty is set.
    output_token_ids: list[int] = field(default_factory=list)
    # The prompt's distinct tokens; empty unless repetition_penalty != 1 (only it looks at the prompt).
    prompt_token_ids: list[int] = field(default_factory=list)

    @property
    def adjusts_logits(self) -> bool:
        """Whether it can change the argmax (min_p alone cannot: greedy rows then skip it)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.bias_token_ids)


@dataclass(slots=True)
class ScheduledSequence:
    seq_id: str
    token_ids: list[int]  # tokens whose KV is computed this step
    start_pos: int  # position of token_ids[0] (== tokens already in the KV cache)
    block_table: list[int]  # every block of the sequence, covering start_pos + len(token_ids)
    sample: bool  # sample a token after the last position of this chunk
    sampling: SamplingSpec
    num_samples: int = 1  # > 1 once, when a prompt with n > 1 finishes prefill: the sequence forks
    sample_index: int = 0  # which of the request's n samples this sequence is (seed mixing)
    output_index: int = 0  # tokens this sequence has generated so far (seed mixing)
    # Token ids the sampler must not pick this step: EOS and stop token ids until min_tokens are out.
    banned_token_ids: list[int] = field(default_factory=list)
    # Structured output: the token ids the sampler may pick this step, one bit per id of the vocabulary
    # (little-endian int32 words, as bytes: 4 * ceil(vocab / 32) of them). None: unconstrained.
    token_bitmask: bytes | None = None
    penalties: PenaltySpec | None = None  # only on rows that sample and ask for one
    lora_slot: int = -1  # the LoRA slot whose adapter this sequence runs with (-1: the base model)
    # Speculative decoding: the last num_draft_tokens of token_ids are drafts to verify. The engine samples
    # after each of the last num_draft_tokens + 1 positions (as if each were the sequence's end, with
    # output_index + i and the drafts before it in the penalties' history), keeps the drafts the target's
    # own samples agree with and returns those plus the target's next token; token_bitmask then holds
    # num_draft_tokens + 1 masks back to back. Requires sample and num_samples == 1.
    num_draft_tokens: int = 0
    # The engine's draft model proposes this many tokens after this step (0: none); the scheduler
    # allocated KV slots for its writes past this step's tokens.
    propose_draft_tokens: int = 0
    # A prompt chunk that does not end the prompt, for an engine whose drafter is an EAGLE-3 head: the
    # prompt's next token (the head reads each position with the token after it); -1 otherwise.
    next_prompt_token: int = -1
    # The block tables of KV groups 1.. (EngineInfo.kv_group_windows; block_table is group 0's): empty for a
    # model with one group. A sliding-window group's entries before its window name block 0 and are never read.
    group_block_tables: list[list[int]] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    step_id: int
    sequences: list[ScheduledSequence]
    # Copy-on-write: (src_block, dst_block) pairs the engine copies before writing this step's KV.
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # (slot, adapter digest) of every LoRA slot a sequence of this step uses: the engine copies an adapter
    # into its slot when the slot holds another one (the scheduler owns the assignment).
    lora_slots: list[tuple[int, str]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.sequences)

    def to_wire(self) -> dict:
        seqs = []
        for s in self.sequences:
            d = {name: getattr(s, name) for name in _WIRED_ALWAYS}
            d["sampling"] = _fields(s.sampling)
            if s.penalties is not None:  # the common row carries nothing of it
                d["penalties"] = _fields(s.penalties)
            if s.group_block_tables:  # nor of these (a model with one KV group)
                d["group_block_tables"] = s.group_block_tables
            seqs.append(d)
        wire = {"step_id": self.step_id, "sequences": seqs, "blocks_to_copy": [list(p) for p in self.blocks_to_copy]}
        if self.lora_slots:
            wire["lora_slots"] = [list(p) for p in self.lora_slots]
        return wire

    @classmethod
    def from_wire(cls, d: dict) -> SchedulerOutput:
        seqs = [
            ScheduledSequence(**{**s, "sampling": SamplingSpec(**s["sampling"]), **_penalties_from_wire(s)})
            for s in d["sequences"]
        ]
        return cls(step_id=d["step_id"], sequences=seqs,
                   blocks_to_copy=[tuple(p) for p in d["blocks_to_copy"]],
                   lora_slots=[tuple(p) for p in d.get("lora_slots", ())])


# Every field of a ScheduledSequence but the optional ones, which go on the wire only when present.
_WIRED_ALWAYS = tuple(name for name in ScheduledSequence.__dataclass_fields__
                      if name not in ("penalties", "group_block_tables"))


def _penalties_from_wire(s: dict) -> dict:
    p = s.get("penalties")
    return {} if p is None else {"penalties": PenaltySpec(**p)}


@dataclass(slots=True)
class TokenLogprobs:
    logprob: float  # of the sampled token
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class ModelRunnerOutput:
    step_id: int
    # For each scheduled sequence with sample=True, in order: num_samples sampled token ids; for one with
    # drafts, the tokens it commits (the accepted drafts, then the target's own next token).
    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # The draft model's proposals for the next step, for sequences scheduled with propose_draft_tokens.
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # A mixture-of-experts model: tokens routed to each expert in this step, summed over its expert layers
    # (empty for a dense model). The scheduler exports the running sums, so imbalance is visible.
    expert_tokens: list[int] = field(default_factory=list)

    def to_wire(self) -> dict:
        wire = {"step_id": self.step_id, "sampled": self.sampled,
                "logprobs": {k: [_fields(x) for x in v] for k, v in self.logprobs.items()}}
        if self.draft_token_ids:
            wire["draft_token_ids"] = self.draft_token_ids
        if self.expert_tokens:
            wire["expert_tokens"] = self.expert_tokens
        return wire

    @classmethod
    def from_wire(cls, d: dict) -> ModelRunnerOutput:
        lps = {k: [TokenLogprobs(**x) for x in v] for k, v in d.get("logprobs", {}).items()}
        return cls(step_id=d["step_id"], sampled=d["sampled"], logprobs=lps,
                   draft_token_ids=d.get("draft_token_ids", {}), expert_tokens=d.get("expert_tokens", []))


@dataclass(slots=True)
class EngineInfo:
    """The engine's handshake: what the scheduler must know to do its bookkeeping."""

    model_id: str
    block_size: int
    num_kv_blocks: int
    max_model_len: int
    vocab_size: int
    dtype: str
    device: str
    eos_token_ids: list[int] = field(default_factory=list)
    max_loras: int = 0  # LoRA slots (0: no adapters)
    max_lora_rank: int = 0
    # The engine's drafter (speculative_config.method: "draft_model" or "eagle3"; "" none) and the most
    # tokens it proposes per step.
    draft_method: str = ""
    max_draft_tokens: int = 0
    # One entry per KV group: the sliding window of its layers, 0 for full attention (services/engine/kv_groups.py)
    kv_group_windows: list[int] = field(default_factory=lambda: [0])
    model_path: str = "pagedserve"  # how the engine runs the model: "pagedserve" (a family module) or "transformers"

    def to_wire(self) -> dict:
        return asdict(self)


class EngineUnavailableError(RuntimeError):
    """The engine cannot be reached, went away mid-step, restarted (its KV cache is gone) or hung: every
    request on it is lost. Nothing about one request causes this."""


@dataclass(frozen=True, slots=True)
class StepFault:
    """One reason the engine refused a step: which sequence (None: the step as a whole), which field."""

    seq_id: str | None
    field: str  # e.g. "token_ids", "block_table", "sampling.temperature", "blocks_to_copy"
    message: str

    def __str__(self) -> str:
        where = "step" if self.seq_id is None else f"sequence {self.seq_id!r}"
        return f"{where}: {self.field}: {self.message}"


class InvalidStepError(ValueError):
    """The engine refused a step because of some of its sequences (named), before any kernel touched
    memory: only their requests fail, the rest of the batch runs again without them. `faults` says
    which field of which sequence (engine side; over the wire only the message and the ids travel). A
    fault of the step as a whole (a copy-on-write pair no sequence owns) names no sequence."""

    def __init__(self, message: str, seq_ids: list[str], faults: list[StepFault] | None = None):
        super().__init__(message)
        self.seq_ids = list(seq_ids)
        self.faults = list(faults or [])

    @classmethod
    def from_faults(cls, faults: list[StepFault]) -> InvalidStepError:
        if not faults:
            raise ValueError("InvalidStepError needs at least one fault")
        shown = "; ".join(str(f) for f in faults[:4])
        more = f" (+{len(faults) - 4} more)" if len(faults) > 4 else ""
        seq_ids = list(dict.fromkeys(f.seq_id for f in faults if f.seq_id is not None))
        return cls(f"invalid step: {shown}{more}", seq_ids, faults)
