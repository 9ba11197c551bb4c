"""What the engine accepts in a step: every field of a `SchedulerOutput` checked against the KV pool,
the model and the sampler's ranges, before any kernel reads memory.

The engine trusts nothing it is sent: a block id outside the pool, a table too short for its positions,
a position past the RoPE table or a token id past the embedding would be an out-of-bounds read on the
device (on CUDA a device-side assert that kills the whole engine). `StepInputBuilder` checks the common
case fast (vectorised, one pass); when that fails, `find_faults` here walks the step field by field and
names every offending sequence and field, so the scheduler can fail just those requests
(`InvalidStepError.seq_ids`).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from services.step_protocol import SchedulerOutput, StepFault

# The sampler's ranges. Seeds are hashed as 64-bit values; a top_k past the vocabulary keeps every token.
MAX_NUM_SAMPLES = 128  # one prompt's forks sampled in the step its prefill ends (the API's largest n)
INDEX_LIMIT = 2 ** 63
SEED_RANGE = (-(2 ** 63), 2 ** 64)


@dataclass(frozen=True)
class StepLimits:
    """The pool and model a step is checked against."""

    block_size: int
    num_kv_blocks: int
    max_model_len: int
    vocab_size: int
    num_kv_groups: int = 1  # block tables each sequence brings: block_table + group_block_tables


def bitmask_size(vocab_size: int) -> int:
    """Bytes of a packed token mask (services.step_protocol.ScheduledSequence.token_bitmask)."""
    return 4 * ((vocab_size + 31) // 32)


def _is_int(v) -> bool:
    return isinstance(v, int)  # Python's rule: a bool is an int


def _is_number(v) -> bool:
    return isinstance(v, (int, float))


def sampling_ok(spec, vocab_size: int) -> bool:
    """The fast check of one SamplingSpec (the same rules as `_sampling_faults`, as one expression)."""
    t, p, k, seed, lp = spec.temperature, spec.top_p, spec.top_k, spec.seed, spec.logprobs
    return (isinstance(t, (int, float)) and 0.0 <= t <= 1.7976931348623157e308
            and isinstance(p, (int, float)) and 0.0 < p <= 1.0
            and isinstance(k, int) and -1 <= k < INDEX_LIMIT
            and (seed is None or (isinstance(seed, int) and SEED_RANGE[0] <= seed < SEED_RANGE[1]))
            and (lp is None or (isinstance(lp, int) and 0 <= lp <= vocab_size)))


def _sampling_faults(seq_id: str, spec, vocab_size: int) -> list[StepFault]:
    out = []

    def bad(field: str, message: str) -> None:
        out.append(StepFault(seq_id, f"sampling.{field}", message))

    t, p, k = getattr(spec, "temperature", None), getattr(spec, "top_p", None), getattr(spec, "top_k", None)
    seed, lp = getattr(spec, "seed", None), getattr(spec, "logprobs", None)
    if not _is_number(t) or not (math.isfinite(t) and t >= 0):
        bad("temperature", f"must be a finite number >= 0, got {t!r}")
    if not _is_number(p) or not (0.0 < p <= 1.0):
        bad("top_p", f"must be in (0, 1], got {p!r}")
    if not _is_int(k) or not (-1 <= k < INDEX_LIMIT):
        bad("top_k", f"must be -1 (disabled) or an integer in [0, 2**63), got {k!r}")
    if seed is not None and (not _is_int(seed) or not (SEED_RANGE[0] <= seed < SEED_RANGE[1])):
        bad("seed", f"must be None or a 64-bit integer, got {_short(seed)}")
    if lp is not None and (not _is_int(lp) or not (0 <= lp <= vocab_size)):
        bad("logprobs", f"must be None or an integer in [0, {vocab_size}], got {_short(lp)}")
    return out


# A PenaltySpec's ranges (services.sampling_params checks the same, more tightly, on the request side).
PENALTY_LIMIT = 2.0
REPETITION_RANGE = (0.01, 100.0)
BIAS_LIMIT = 100.0
MAX_BIAS_ENTRIES = 300


def _in(v, lo: float, hi: float) -> bool:
    return isinstance(v, (int, float)) and lo <= v <= hi  # NaN compares false: refused


def _id_list_ok(values, vocab_size: int, max_len: int) -> bool:
    if type(values) is not list or len(values) > max_len:
        return False
    return all(type(v) is int and 0 <= v < vocab_size for v in values)


def penalties_ok(p, vocab_size: int, max_model_len: int) -> bool:
    """The check of one PenaltySpec: every token id indexes the vocabulary, every number in its range."""
    return not _penalty_faults("", p, vocab_size, max_model_len)


def _penalty_faults(seq_id: str, p, vocab_size: int, max_model_len: int) -> list[StepFault]:
    out = []

    def bad(field: str, message: str) -> None:
        out.append(StepFault(seq_id, f"penalties.{field}", message))

    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(p, name, None)
        if not _in(v, -PENALTY_LIMIT, PENALTY_LIMIT):
            bad(name, f"must be a number in [-{PENALTY_LIMIT}, {PENALTY_LIMIT}], got {_short(v)}")
    v = getattr(p, "repetition_penalty", None)
    if not _in(v, *REPETITION_RANGE):
        bad("repetition_penalty", f"must be a number in {list(REPETITION_RANGE)}, got {_short(v)}")
    v = getattr(p, "min_p", None)
    if not _in(v, 0.0, 1.0):
        bad("min_p", f"must be a number in [0, 1], got {_short(v)}")
    ids, values = getattr(p, "bias_token_ids", None), getattr(p, "bias_values", None)
    if not _id_list_ok(ids, vocab_size, MAX_BIAS_ENTRIES):
        bad("bias_token_ids", f"must be at most {MAX_BIAS_ENTRIES} token ids in [0, {vocab_size})")
    elif (type(values) is not list or len(values) != len(ids)
          or not all(_in(b, -BIAS_LIMIT, BIAS_LIMIT) for b in values)):
        bad("bias_values", f"must be one number in [-{BIAS_LIMIT}, {BIAS_LIMIT}] per bias_token_ids entry")
    for name in ("output_token_ids", "prompt_token_ids"):
        if not _id_list_ok(getattr(p, name, None), vocab_size, max_model_len):
            bad(name, f"must be at most {max_model_len} token ids in [0, {vocab_size})")
    return out


def _short(v) -> str:
    # Never str() a huge int: past 4300 digits Python refuses (ValueError) instead of printing it.
    text = repr(v) if not _is_int(v) or abs(v) < 10 ** 30 else f"an integer of {v.bit_length()} bits"
    return text if len(text) <= 80 else text[:77] + "..."


def _int_list_fault(values, lo: int, hi: int, what: str) -> str | None:
    """Why `values` is not a list of ints in [lo, hi), or None."""
    if not isinstance(values, list):
        return f"must be a list of {what}, got {type(values).__name__}"
    for i, v in enumerate(values):
        if not _is_int(v):
            return f"entry {i} is {type(v).__name__} {_short(v)}, not an integer"
        if not lo <= v < hi:
            return f"entry {i} = {_short(v)} is outside [{lo}, {hi})"
    return None


def _seq_id(s) -> str:
    return s.seq_id if isinstance(s.seq_id, str) else repr(s.seq_id)


def _sequence_faults(s, limits: StepLimits) -> list[StepFault]:
    seq_id = _seq_id(s)
    out = []

    def bad(field: str, message: str) -> None:
        out.append(StepFault(seq_id, field, message))

    if not isinstance(s.seq_id, str):
        bad("seq_id", f"must be a string, got {type(s.seq_id).__name__}")
    tokens, start, table = s.token_ids, s.start_pos, s.block_table
    why = _int_list_fault(tokens, 0, limits.vocab_size, "token ids")
    if why:
        bad("token_ids", f"{why} (the vocabulary has {limits.vocab_size} tokens)")
    elif not tokens:
        bad("token_ids", "must hold at least one token")
    if not _is_int(start) or start < 0:
        bad("start_pos", f"must be an integer >= 0, got {_short(start)}")
    elif isinstance(tokens, list) and start + len(tokens) > limits.max_model_len:
        bad("start_pos", f"positions {start}..{start + len(tokens) - 1} reach past max_model_len "
                         f"{limits.max_model_len}")
    groups = s.group_block_tables
    if not isinstance(groups, list) or len(groups) != limits.num_kv_groups - 1:
        bad("group_block_tables", f"must be a list of {limits.num_kv_groups - 1} block tables (the model has "
                                  f"{limits.num_kv_groups} KV groups), got {_short(groups)}")
        groups = []
    for field, t in [("block_table", table), *((f"group_block_tables[{g}]", t) for g, t in enumerate(groups))]:
        why = _int_list_fault(t, 0, limits.num_kv_blocks, "block ids")
        if why:
            bad(field, f"{why} (the pool has {limits.num_kv_blocks} blocks)")
        elif _is_int(start) and isinstance(tokens, list):
            need = -(-(start + len(tokens)) // limits.block_size)
            if len(t) < need:
                bad(field, f"{len(t)} blocks cover {len(t) * limits.block_size} positions; "
                           f"start_pos + len(token_ids) = {start + len(tokens)} needs {need}")
    if s.sample is not True and s.sample is not False:
        bad("sample", f"must be a bool, got {_short(s.sample)}")
    for field in ("sample_index", "output_index"):
        v = getattr(s, field)
        if not _is_int(v) or not 0 <= v < INDEX_LIMIT:
            bad(field, f"must be an integer in [0, 2**63), got {_short(v)}")
    if s.sample is True:
        ns = s.num_samples
        if not _is_int(ns) or not 1 <= ns <= MAX_NUM_SAMPLES:
            bad("num_samples", f"must be an integer in [1, {MAX_NUM_SAMPLES}], got {_short(ns)}")
        out += _sampling_faults(seq_id, s.sampling, limits.vocab_size)
        banned = s.banned_token_ids
        why = _int_list_fault(banned, 0, INDEX_LIMIT, "token ids")
        if why is None and len(banned) > limits.vocab_size:
            why = f"{len(banned)} ids, more than the vocabulary's {limits.vocab_size}"
        if why:
            bad("banned_token_ids", why)
        mask = s.token_bitmask
        size = bitmask_size(limits.vocab_size)
        if mask is not None and (type(mask) is not bytes or len(mask) != size):
            bad("token_bitmask", f"must be {size} bytes (a bit per token id of the vocabulary of "
                                 f"{limits.vocab_size}), got {_short(mask) if type(mask) is not bytes else len(mask)}")
        if s.penalties is not None:
            out += _penalty_faults(seq_id, s.penalties, limits.vocab_size, limits.max_model_len)
    return out


def _written_slot_faults(seqs, limits: StepLimits) -> list[StepFault]:
    """Two sequences writing one KV slot in one step: a copy-on-write the scheduler forgot."""
    owner: dict[int, tuple[str, int]] = {}
    out = []
    bs = limits.block_size
    for s in seqs:
        for g, table in enumerate([s.block_table, *s.group_block_tables]):
            field = "block_table" if g == 0 else f"group_block_tables[{g - 1}]"
            clash = None
            for p in range(s.start_pos, s.start_pos + len(s.token_ids)):
                slot = table[p // bs] * bs + p % bs
                other = owner.setdefault(slot, (s.seq_id, g))
                if other != (s.seq_id, g):
                    clash = (f"position {p} writes KV slot {slot} (block {slot // bs}), also written by "
                             f"{other[0]!r} (KV group {other[1]})")
                    break
            if clash:
                out.append(StepFault(_seq_id(s), field, clash))
                break
    return out


def _copy_faults(out: SchedulerOutput, limits: StepLimits) -> list[StepFault]:
    pairs = out.blocks_to_copy
    if not isinstance(pairs, list):
        return [StepFault(None, "blocks_to_copy", f"must be a list of (src, dst) pairs, got {type(pairs).__name__}")]
    faults = []
    holders: dict[int, list[str]] = {}
    for s in out.sequences:
        if isinstance(s.block_table, list):
            for b in s.block_table:
                if _is_int(b):
                    holders.setdefault(b, []).append(_seq_id(s))
    dsts = Counter(p[1] for p in pairs if isinstance(p, (list, tuple)) and len(p) == 2)
    srcs = {p[0] for p in pairs if isinstance(p, (list, tuple)) and len(p) == 2}
    for i, pair in enumerate(pairs):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            faults.append(StepFault(None, "blocks_to_copy", f"pair {i} is not (src, dst): {_short(pair)}"))
            continue
        src, dst = pair
        why = _int_list_fault([src, dst], 0, limits.num_kv_blocks, "block ids")
        if why is None and src == dst:
            why = "copies a block onto itself"
        elif why is None and dsts[dst] > 1:
            why = f"block {dst} is the destination of {dsts[dst]} copies"
        elif why is None and dst in srcs:
            why = f"block {dst} is both a source and a destination"
        if why:
            owners = holders.get(dst, []) if _is_int(dst) else []
            message = f"pair {i} ({_short(src)} -> {_short(dst)}): {why}"
            faults += [StepFault(o, "blocks_to_copy", message) for o in owners] or [
                StepFault(None, "blocks_to_copy", message)]
    return faults


def find_faults(out: SchedulerOutput, limits: StepLimits) -> list[StepFault]:
    """Every fault of the step, field by field (the slow path: only run once the fast check failed)."""
    faults: list[StepFault] = []
    seqs = out.sequences
    ids = Counter(_seq_id(s) for s in seqs)
    for seq_id, count in ids.items():
        if count > 1:
            faults.append(StepFault(seq_id, "seq_id", f"appears {count} times in one step"))
    sound = []
    for s in seqs:
        found = _sequence_faults(s, limits)
        faults += found
        if not found:
            sound.append(s)
    faults += _written_slot_faults(sound, limits)
    faults += _copy_faults(out, limits)
    return faults
