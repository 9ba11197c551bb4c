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

from collections import Counter
from dataclasses import dataclass

from services.contracts.step_protocol import SchedulerOutput, StepFault
from services.request import limits as L

MAX_NUM_SAMPLES = L.MAX_N  # one prompt's forks sampled in the step its prefill ends (the API's largest n)
MAX_DRAFT_TOKENS = 16  # draft tokens one sequence verifies in a step (speculative decoding)
INDEX_LIMIT = 2 ** 63


@dataclass(frozen=True)
class StepLimits:
    """The pool and model a step is checked against."""

    block_size: int
    num_kv_blocks: int
    max_model_len: int
    vocab_size: int
    max_propose: int = 0  # tokens the engine's drafter may be asked to propose (0: it has none)
    num_kv_groups: int = 1  # block tables each sequence brings: block_table + group_block_tables


def bitmask_size(vocab_size: int) -> int:
    """Bytes of a packed token mask (services.contracts.step_protocol.ScheduledSequence.token_bitmask)."""
    return 4 * ((vocab_size + 31) // 32)


def _is_int(v) -> bool:
    return isinstance(v, int)  # Python's rule: a bool is an int


def _is_number(v) -> bool:
    return isinstance(v, (int, float))


def sampling_ok(spec, vocab_size: int) -> bool:
    """The fast check of one SamplingSpec (the same rules as `_sampling_faults`, as one expression)."""
    t, p, k, seed, lp = spec.temperature, spec.top_p, spec.top_k, spec.seed, spec.logprobs
    return (L.wire_temperature_ok(t) and L.TOP_P.admits(p) and L.TOP_K.admits(k) and k <= vocab_size
            and (seed is None or L.SEED.admits(seed))
            and (lp is None or (L.WIRE_LOGPROBS.admits(lp) and lp <= vocab_size)))


def _sampling_faults(seq_id: str, spec, vocab_size: int) -> list[StepFault]:
    """The request's own ranges (services.request.limits), as the scheduler put them on the wire."""
    out = []

    def bad(field: str, message: str) -> None:
        out.append(StepFault(seq_id, f"sampling.{field}", message))

    t, p, k = getattr(spec, "temperature", None), getattr(spec, "top_p", None), getattr(spec, "top_k", None)
    seed, lp = getattr(spec, "seed", None), getattr(spec, "logprobs", None)
    if not L.wire_temperature_ok(t):
        bad("temperature", f"must be 0 or {L.TEMPERATURE.describe()} of at least {L.MIN_TEMPERATURE} (the "
                           f"scheduler floors smaller ones to 0), got {_short(t)}")
    if not L.TOP_P.admits(p):
        bad("top_p", f"must be {L.TOP_P.describe()}, got {_short(p)}")
    if not L.TOP_K.admits(k):
        bad("top_k", f"must be {L.TOP_K.describe()}, got {_short(k)}")
    elif k > vocab_size:
        bad("top_k", f"{k} exceeds the vocabulary size {vocab_size}")
    if seed is not None and not L.SEED.admits(seed):
        bad("seed", f"must be None or {L.SEED.describe()}, got {_short(seed)}")
    if lp is not None and (not L.WIRE_LOGPROBS.admits(lp) or lp > vocab_size):
        bad("logprobs", f"must be None or {L.WIRE_LOGPROBS.describe()} and at most the vocabulary size "
                        f"{vocab_size}, got {_short(lp)}")
    return out


def _id_list_ok(values, vocab_size: int, max_len: int) -> bool:
    if type(values) is not list or len(values) > max_len:
        return False
    return all(type(v) is int and 0 <= v < vocab_size for v in values)


def penalties_ok(p, vocab_size: int, max_model_len: int) -> bool:
    """The check of one PenaltySpec: every token id indexes the vocabulary, every number in its range."""
    return not _penalty_faults("", p, vocab_size, max_model_len)


def _penalty_faults(seq_id: str, p, vocab_size: int, max_model_len: int) -> list[StepFault]:
    """The request's ranges of penalties, min_p and logit bias (services.request.limits)."""
    out = []

    def bad(field: str, message: str) -> None:
        out.append(StepFault(seq_id, f"penalties.{field}", message))

    for name, bound in (("presence_penalty", L.PENALTY), ("frequency_penalty", L.PENALTY),
                        ("repetition_penalty", L.REPETITION_PENALTY), ("min_p", L.MIN_P)):
        v = getattr(p, name, None)
        if not bound.admits(v):
            bad(name, f"must be {bound.describe()}, got {_short(v)}")
    ids, values = getattr(p, "bias_token_ids", None), getattr(p, "bias_values", None)
    if not _id_list_ok(ids, vocab_size, L.MAX_LOGIT_BIAS):
        bad("bias_token_ids", f"must be at most {L.MAX_LOGIT_BIAS} token ids in [0, {vocab_size})")
    elif (type(values) is not list or len(values) != len(ids)
          or not all(L.LOGIT_BIAS.admits(b) for b in values)):
        bad("bias_values", f"must be one {L.LOGIT_BIAS.describe()} per bias_token_ids entry")
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
    _check_drafts(s, limits, bad)
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
        k = s.num_draft_tokens
        positions = k + 1 if _is_int(k) and 0 <= k <= MAX_DRAFT_TOKENS else 1
        size = bitmask_size(limits.vocab_size) * positions
        if mask is not None and (type(mask) is not bytes or len(mask) != size):
            bad("token_bitmask", f"must be {size} bytes (a bit per token id of the vocabulary of "
                                 f"{limits.vocab_size}, for each of {positions} positions), "
                                 f"got {_short(mask) if type(mask) is not bytes else len(mask)}")
        if s.penalties is not None:
            out += _penalty_faults(seq_id, s.penalties, limits.vocab_size, limits.max_model_len)
    return out


def _check_drafts(s, limits: StepLimits, bad) -> None:
    """Speculative decoding's fields: drafts only on a row that samples once, fewer than its tokens; a
    drafter's proposal only where the engine has one, with KV slots for what it writes ahead."""
    k, ahead, n = s.num_draft_tokens, s.propose_draft_tokens, len(s.token_ids) if isinstance(s.token_ids, list) else 0
    single = s.sample is True and s.num_samples == 1
    if not _is_int(k) or not 0 <= k <= MAX_DRAFT_TOKENS:
        bad("num_draft_tokens", f"must be an integer in [0, {MAX_DRAFT_TOKENS}], got {_short(k)}")
    elif k and not single:
        bad("num_draft_tokens", "drafts need a row that samples one token (sample, num_samples == 1)")
    elif k and k >= n:
        bad("num_draft_tokens", f"{k} drafts in {n} tokens: at least one token must precede them")
    nxt = s.next_prompt_token
    if nxt != -1 and not (_is_int(nxt) and 0 <= nxt < limits.vocab_size and s.sample is False):
        bad("next_prompt_token", f"must be -1 or, on a chunk that samples nothing, a token id in "
                                 f"[0, {limits.vocab_size}), got {_short(nxt)}")
    if not _is_int(ahead) or not 0 <= ahead <= limits.max_propose:
        bad("propose_draft_tokens", f"must be an integer in [0, {limits.max_propose}] (this engine's drafter), "
                                    f"got {_short(ahead)}")
    elif ahead and not single:
        bad("propose_draft_tokens", "a proposal needs a row that samples one token (sample, num_samples == 1)")
    elif ahead and _is_int(s.start_pos) and isinstance(s.block_table, list):
        need = -(-(s.start_pos + n + ahead) // limits.block_size)
        if len(s.block_table) < need:
            bad("block_table", f"{len(s.block_table)} blocks leave no KV slots for the {ahead} tokens the drafter "
                               f"writes past position {s.start_pos + n - 1} (needs {need})")


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
