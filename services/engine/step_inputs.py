"""The inputs of one engine step, built once on the host from a `SchedulerOutput` and sent to the device
in one copy.

Everything the kernels read (token ids, positions, KV slots, rows to sample, copy-on-write pairs,
block tables, query starts, context lengths) is laid out in one flat byte buffer, pinned on CUDA, and
the numbers that size the kernels' grids (longest context, longest chunk) stay host-side Python ints.
The model's forward then never reads a device tensor back: no sync inside a layer, and a decode step
can be replayed from a CUDA graph. While it builds, `StepInputBuilder` validates the step against the
pool and the model (services/engine/step_validation.py) and raises `InvalidStepError` naming the
sequences at fault before any kernel runs.

This is the one typed place a step's host-side inputs live: the model runner, the CUDA-graph runner
and every tensor-parallel rank run the same `StepInputs` (rank 0 builds it; the others receive its
buffer, services/engine/step_broadcast.py).
"""

from __future__ import annotations

import array
from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from services.contracts.step_protocol import InvalidStepError, SchedulerOutput, StepFault
from services.engine.attention import AttentionMetadata
from services.engine.sampler import SampleRow
from services.engine.spec_decode.verify import draft_rows
from services.engine.step_layout import StepLayout, StepTensors, decode_graph_layout
from services.engine.step_validation import (
    INDEX_LIMIT,
    MAX_DRAFT_TOKENS,
    MAX_NUM_SAMPLES,
    StepLimits,
    bitmask_size,
    find_faults,
    penalties_ok,
    sampling_ok,
)


@dataclass
class StepInputs:
    """One validated step, host side: the filled buffer plus the numbers that size the kernels."""

    layout: StepLayout
    host: torch.Tensor  # uint8 [layout.nbytes], pinned on CUDA
    num_tokens: int
    num_decode: int  # the first num_decode tokens are single-token decodes (padding included)
    decode_max_context_len: int
    prefill_max_query_len: int
    prefill_max_context_len: int
    # (q_start, q_end, context_len) per prefill sequence, relative to num_decode (the CPU backend).
    prefill_spans: list[tuple[int, int, int]]
    rows: list[SampleRow]  # what to sample, in the order of sample_idx
    owners: list[str]  # seq_id of each row
    num_copies: int = 0
    graph_batch: int | None = None  # a decode-only step padded to this captured batch size
    num_real_decodes: int = 0
    # (LoRA slot, first token, end token) of each sequence's tokens in the batch; empty: no adapter
    lora_segments: list[tuple[int, int, int]] = field(default_factory=list)
    # seq_id -> the draft tokens its rows verify (speculative decoding); its owners appear k + 1 times
    drafts: dict[str, list[int]] = field(default_factory=dict)
    # seq_id -> where its first token sits in the flattened batch (an EAGLE-3 head reads the target's
    # hidden states by it); filled for eager steps
    token_offsets: dict[str, int] = field(default_factory=dict)

    @property
    def num_sampled(self) -> int:
        """Rows whose logits are wanted: a graph step's padding rows never are."""
        return self.num_real_decodes if self.graph_batch is not None else self.layout.shapes["sample_idx"][0]

    def upload(self, device: torch.device) -> StepTensors:
        """The one host-to-device copy of the step (non-blocking from pinned memory; none on the CPU)."""
        buf = self.host if device.type == "cpu" else self.host.to(device, non_blocking=True)
        return self.layout.tensors(buf)

    def attention_metadata(self, t: StepTensors, attn, num_kv_heads: int, group: int = 0) -> AttentionMetadata:
        """What `attn` (a model's PagedAttention, with this many KV heads on this rank) reads of the step, for
        the layers of KV group `group` (its slots and block tables; everything else is shared)."""
        nd = self.num_decode
        splits = attn.backend.num_splits(nd, num_kv_heads, self.decode_max_context_len) if nd else None
        return AttentionMetadata(
            slot_mapping=t.slot_mapping[group], num_decode=nd, decode_block_tables=t.decode_block_tables[group],
            decode_context_lens=t.decode_context_lens, decode_max_context_len=self.decode_max_context_len,
            decode_num_splits=splits, prefill_block_tables=t.prefill_block_tables[group],
            prefill_query_start_loc=t.prefill_query_start_loc, prefill_context_lens=t.prefill_context_lens,
            prefill_max_query_len=self.prefill_max_query_len, prefill_max_context_len=self.prefill_max_context_len,
            prefill_spans=self.prefill_spans, step_cache={})


class StepInputBuilder:
    """Turns a SchedulerOutput into StepInputs, validating it against the pool and the model.

    The common case is checked as it is laid out: scalar fields per sequence, token and block ids as
    one 64-bit array each (which refuses a float, string, None or oversized int), KV slots for
    duplicates. Only when that fails does `find_faults` walk the step to name every fault. Integers
    are Python's: a bool counts as one.
    """

    def __init__(self, limits: StepLimits, device: torch.device):
        self.limits = limits
        self.pin = device.type == "cuda"
        self.num_groups = limits.num_kv_groups

    def _fail(self, out: SchedulerOutput) -> InvalidStepError:
        faults = find_faults(out, self.limits)
        # The fast check and the field-by-field walk follow the same rules; should they ever disagree,
        # the step is still refused rather than run.
        return InvalidStepError.from_faults(faults or [StepFault(None, "step", "malformed step (no field named)")])

    def _alloc(self, layout: StepLayout) -> tuple[torch.Tensor, dict[str, np.ndarray]]:
        host = torch.empty(layout.nbytes, dtype=torch.uint8, pin_memory=self.pin)
        return host, layout.host_views(host.numpy())

    def build(self, out: SchedulerOutput, graph_batch_for=None) -> StepInputs:
        """`graph_batch_for(num_decodes, max_context_len, uses_lora)`: the captured batch size a decode-only step
        may be padded to (None: run it eagerly)."""
        try:
            return self._build(out, graph_batch_for)
        except _Refused:
            raise self._fail(out) from None
        except (TypeError, ValueError, OverflowError, AttributeError, IndexError):
            # Malformed beyond the fast checks (an unhashable id, a nested list, ...).
            raise self._fail(out) from None

    def _build(self, out: SchedulerOutput, graph_batch_for) -> StepInputs:
        lim = self.limits
        bs, max_len, vocab = lim.block_size, lim.max_model_len, lim.vocab_size
        extra_groups = self.num_groups - 1
        seqs = out.sequences
        decodes, prefills = [], []
        ok = len({s.seq_id for s in seqs}) == len(seqs)
        for s in seqs:
            n, start = len(s.token_ids), s.start_pos
            ok = (ok and type(s.seq_id) is str and type(s.token_ids) is list and type(s.block_table) is list
                  and isinstance(start, int) and n >= 1 and start >= 0
                  and start + n <= max_len and len(s.block_table) * bs >= start + n
                  and isinstance(s.sample_index, int) and 0 <= s.sample_index < INDEX_LIMIT
                  and isinstance(s.output_index, int) and 0 <= s.output_index < INDEX_LIMIT)
            k, ahead = s.num_draft_tokens, s.propose_draft_tokens
            tables = s.group_block_tables
            ok = ok and type(tables) is list and len(tables) == extra_groups and (
                not extra_groups or all(type(t) is list and len(t) * bs >= start + n for t in tables))
            if s.sample is True:
                banned, mask = s.banned_token_ids, s.token_bitmask
                ok = (ok and isinstance(s.num_samples, int) and 1 <= s.num_samples <= MAX_NUM_SAMPLES
                      and type(k) is int and 0 <= k <= MAX_DRAFT_TOKENS and k < n and (not k or s.num_samples == 1)
                      and type(ahead) is int and 0 <= ahead <= lim.max_propose and (not ahead or s.num_samples == 1)
                      and len(s.block_table) * bs >= start + n + ahead
                      and sampling_ok(s.sampling, vocab) and type(banned) is list and len(banned) <= vocab
                      and (mask is None or (type(mask) is bytes and len(mask) == (k + 1) * bitmask_size(vocab))))
                if ok and banned:
                    self._ints(banned, INDEX_LIMIT)
                if ok and s.penalties is not None and not penalties_ok(s.penalties, vocab, max_len):
                    raise _Refused
            elif s.sample is not False or k != 0 or ahead != 0:
                ok = False
            nxt = s.next_prompt_token
            if nxt != -1 and not (type(nxt) is int and 0 <= nxt < vocab and s.sample is False):
                raise _Refused
            if not ok:
                raise _Refused
            (decodes if n == 1 else prefills).append(s)
        pairs = out.blocks_to_copy
        if pairs and not self._copies_ok(pairs):
            raise _Refused
        # Decodes that share prefix blocks sit next to each other, so the attention kernel finds the
        # shared blocks still in cache when it reaches the next sequence of the group. (Every table has
        # a first block by now; one that cannot be compared raises TypeError: refused below.)
        decodes.sort(key=lambda s: s.block_table[0])
        decode_blocks, prefill_blocks = self._group_entries(decodes), self._group_entries(prefills)
        nd, npf = len(decodes), len(prefills)
        decode_max = max((s.start_pos + 1 for s in decodes), default=0)
        batch = None
        # Decodes with adapters replay a graph only where the graphs were captured with the LoRA slots.
        # A speculative verify row (every token sampled: the last committed one and its drafts) is as many
        # decode rows, each over the context up to its own position: a step of decodes and verify rows
        # replays a decode graph too.
        if graph_batch_for is not None and not pairs and all(s.sample and s.num_samples == 1 for s in decodes) \
                and all(_verify_only(s) for s in prefills) and (nd or npf):
            rows = nd + sum(len(s.token_ids) for s in prefills)
            longest = max(decode_max, max((s.start_pos + len(s.token_ids) for s in prefills), default=0))
            batch = graph_batch_for(rows, longest, any(s.lora_slot >= 0 for s in chain(decodes, prefills)))
        if batch is not None:
            return self._decode_graph_step(decodes, prefills, decode_blocks, batch)
        return self._eager_step(out, decodes, prefills, decode_blocks, prefill_blocks, decode_max)

    def _copies_ok(self, pairs) -> bool:
        nb = self.limits.num_kv_blocks
        srcs = {p[0] for p in pairs}
        dsts = {p[1] for p in pairs}
        return (len(dsts) == len(pairs) and not srcs & dsts and all(
            len(p) == 2 and isinstance(p[0], int) and isinstance(p[1], int) and 0 <= p[0] < nb and 0 <= p[1] < nb
            for p in pairs))

    def _ints(self, values: list, hi: int) -> np.ndarray:
        """`values` as int64, every one an integer in [0, hi); else the step is refused (array.array
        raises TypeError for a float, string or None and OverflowError past 64 bits)."""
        if not values:
            return np.zeros(0, dtype=np.int64)
        arr = np.frombuffer(array.array("q", values), dtype=np.int64)
        if arr.min() < 0 or arr.max() >= hi:
            raise _Refused
        return arr

    def _table_entries(self, tables: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        """(lengths, every entry concatenated) of block tables, checked."""
        lens = np.fromiter((len(t) for t in tables), dtype=np.int64, count=len(tables))
        return lens, self._ints(list(chain.from_iterable(tables)), self.limits.num_kv_blocks)

    def _group_entries(self, seqs) -> list[tuple[np.ndarray, np.ndarray]]:
        """`_table_entries` of each KV group's tables of the sequences (group 0: `block_table`)."""
        out = [self._table_entries([s.block_table for s in seqs])]
        for g in range(self.num_groups - 1):
            out.append(self._table_entries([s.group_block_tables[g] for s in seqs]))
        return out

    @staticmethod
    def _width(entries) -> int:
        return max(int(lens.max(initial=0)) for lens, _ in entries)

    @staticmethod
    def _fill_tables(dst: np.ndarray, entries) -> None:
        lens, flat = entries
        dst.fill(0)  # padding columns name block 0: valid memory, never read past a context
        dst[:len(lens)][np.arange(dst.shape[1])[None, :] < lens[:, None]] = flat

    def _rows(self, ordered) -> tuple[list[int], list[SampleRow], list[str]]:
        """The last token of each sequence that samples, once per requested sample; a sequence with k drafts
        samples after each of its last k + 1 tokens (services.engine.spec_decode.verify)."""
        sample_idx, rows, owners = [], [], []
        end = 0
        mask_bytes = bitmask_size(self.limits.vocab_size)
        for s in ordered:
            end += len(s.token_ids)
            if s.sample and s.num_draft_tokens:
                k = s.num_draft_tokens
                sample_idx.extend(range(end - k - 1, end))
                rows += draft_rows(s, mask_bytes)
                owners += [s.seq_id] * (k + 1)
            elif s.sample:
                for j in range(s.num_samples):
                    sample_idx.append(end - 1)
                    rows.append(SampleRow(s.sampling, s.sample_index + j, s.output_index, s.banned_token_ids,
                                          s.token_bitmask, s.penalties))
                    owners.append(s.seq_id)
        return sample_idx, rows, owners

    def _decode_slots(self, v, decodes, entries) -> None:
        """Fill the decode rows' tables, positions, context lengths and (every group's) KV slots."""
        bs, nd = self.limits.block_size, len(decodes)
        pos = np.fromiter((s.start_pos for s in decodes), dtype=np.int64, count=nd)
        v["positions"][:nd] = pos
        v["decode_context_lens"][:nd] = pos + 1
        for g, group_entries in enumerate(entries):
            dt = v["decode_block_tables"][g]
            self._fill_tables(dt, group_entries)
            v["slot_mapping"][g, :nd] = dt[np.arange(nd), pos // bs].astype(np.int64) * bs + pos % bs

    def _eager_step(self, out, decodes, prefills, decode_blocks, prefill_blocks, decode_max: int) -> StepInputs:
        bs = self.limits.block_size
        nd, npf = len(decodes), len(prefills)
        q_lens = [len(s.token_ids) for s in prefills]
        num_tokens = nd + sum(q_lens)
        sample_idx, rows, owners = self._rows(decodes + prefills)
        pairs = out.blocks_to_copy
        layout = StepLayout.of(
            num_tokens=num_tokens, num_samples=len(sample_idx), num_decode=nd, decode_width=self._width(decode_blocks),
            num_prefill=npf, prefill_width=self._width(prefill_blocks), num_copies=len(pairs),
            num_groups=self.num_groups)
        host, v = self._alloc(layout)
        tokens = [s.token_ids[0] for s in decodes]
        tokens += chain.from_iterable(s.token_ids for s in prefills)
        v["input_ids"][:] = self._ints(tokens, self.limits.vocab_size)
        v["sample_idx"][:] = sample_idx
        if pairs:
            v["copy_src"][:] = [p[0] for p in pairs]
            v["copy_dst"][:] = [p[1] for p in pairs]
        slots = v["slot_mapping"]
        if nd:
            self._decode_slots(v, decodes, decode_blocks)
        spans, max_q, max_ctx = [], 0, 0
        if npf:
            starts = np.fromiter((s.start_pos for s in prefills), dtype=np.int64, count=npf)
            lens = np.asarray(q_lens, dtype=np.int64)
            qsl = v["prefill_query_start_loc"]
            qsl[0] = 0
            np.cumsum(lens, out=qsl[1:], dtype=np.int32)
            ctx = starts + lens
            v["prefill_context_lens"][:] = ctx
            row = np.repeat(np.arange(npf), lens)
            pos = np.arange(num_tokens - nd, dtype=np.int64) - np.repeat(qsl[:-1].astype(np.int64) - starts, lens)
            v["positions"][nd:] = pos
            for g, group_entries in enumerate(prefill_blocks):
                pt = v["prefill_block_tables"][g]
                self._fill_tables(pt, group_entries)
                slots[g, nd:] = pt[row, pos // bs].astype(np.int64) * bs + pos % bs
            bounds, ctx_list = qsl.tolist(), ctx.tolist()
            spans = [(bounds[i], bounds[i + 1], ctx_list[i]) for i in range(npf)]
            max_q, max_ctx = int(lens.max()), int(ctx.max())
        if np.unique(slots).size != slots.size:
            # Two sequences (or groups) writing one KV slot: a copy-on-write the scheduler forgot.
            raise _Refused
        return StepInputs(layout, host, num_tokens, nd, decode_max, max_q, max_ctx, spans, rows, owners,
                          num_copies=len(pairs), num_real_decodes=nd,
                          lora_segments=self._lora_segments(decodes + prefills),
                          drafts=_drafts(prefills),
                          token_offsets=self._offsets(decodes + prefills))

    @staticmethod
    def _offsets(ordered) -> dict[str, int]:
        out, at = {}, 0
        for s in ordered:
            out[s.seq_id] = at
            at += len(s.token_ids)
        return out

    @staticmethod
    def _lora_segments(ordered) -> list[tuple[int, int, int]]:
        if all(s.lora_slot < 0 for s in ordered):
            return []
        out, at = [], 0
        for s in ordered:
            n = len(s.token_ids)
            if s.lora_slot >= 0:
                out.append((s.lora_slot, at, at + n))
            at += n
        return out

    def _decode_graph_step(self, decodes, verifies, decode_blocks, batch: tuple[int, int]) -> StepInputs:
        """A step of decodes (and verify rows, one decode row per token) padded to a captured batch size:
        padding rows write nowhere (slot -1), attend to one position of block 0 and are never sampled.
        Every real row is sampled, in order: a verify row's k + 1 sample rows are its k + 1 tokens."""
        size, width = batch
        ordered = decodes + verifies
        rows_in = decodes + [_TokenRow(s, j) for s in verifies for j in range(len(s.token_ids))]
        entries = self._group_entries(rows_in) if verifies else decode_blocks
        nd = len(rows_in)
        layout = decode_graph_layout(size, width, self.num_groups)
        host, v = self._alloc(layout)
        ids, slots = v["input_ids"], v["slot_mapping"]
        ids[:nd] = self._ints([s.token_ids[0] for s in rows_in], self.limits.vocab_size)
        ids[nd:] = 0
        self._decode_slots(v, rows_in, entries)
        if np.unique(slots[:, :nd]).size != nd * self.num_groups:
            raise _Refused
        slots[:, nd:] = -1
        v["positions"][nd:] = 0
        v["decode_context_lens"][nd:] = 1
        v["sample_idx"][:] = np.arange(size)
        _, rows, owners = self._rows(ordered)
        assert len(rows) == nd, "every real row of a graph step is sampled"
        return StepInputs(layout, host, size, size, width * self.limits.block_size, 0, 0, [], rows, owners,
                          graph_batch=size, num_real_decodes=nd, lora_segments=self._lora_segments(rows_in),
                          drafts=_drafts(verifies),
                          token_offsets=self._offsets(ordered))


def _drafts(seqs) -> dict[str, list[int]]:
    """seq_id -> the draft tokens it verifies (the last num_draft_tokens of its tokens), for those with any."""
    return {s.seq_id: s.token_ids[len(s.token_ids) - s.num_draft_tokens:] for s in seqs if s.num_draft_tokens}


def _verify_only(s) -> bool:
    """A sequence whose every token is sampled: its last committed token and the drafts it verifies."""
    return s.sample is True and s.num_samples == 1 and s.num_draft_tokens == len(s.token_ids) - 1 \
        and s.next_prompt_token == -1


class _TokenRow:
    """Token j of a verify row as a decode row of a graph step: what the decode layout reads of it."""

    __slots__ = ("token_ids", "start_pos", "block_table", "group_block_tables", "lora_slot")

    def __init__(self, s, j: int):
        self.token_ids = s.token_ids[j:j + 1]
        self.start_pos = s.start_pos + j
        self.block_table, self.group_block_tables, self.lora_slot = s.block_table, s.group_block_tables, s.lora_slot


class _Refused(Exception):
    """The fast check failed: `find_faults` says why."""


def padding_step(size: int, width: int, block_size: int, num_groups: int = 1) -> StepInputs:
    """A decode step of `size` padding rows only: what graphs are warmed up and captured with (it writes
    no KV slot and reads only position 0 of block 0)."""
    layout = decode_graph_layout(size, width, num_groups)
    host = torch.zeros(layout.nbytes, dtype=torch.uint8)
    v = layout.host_views(host.numpy())
    v["slot_mapping"][:] = -1
    v["decode_context_lens"][:] = 1
    v["sample_idx"][:] = np.arange(size)
    return StepInputs(layout, host, size, size, width * block_size, 0, 0, [], [], [], graph_batch=size)
