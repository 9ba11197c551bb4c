"""Random paged-attention inputs and a float64 dense attention to judge kernels by.

Shared by the kernel tests and `kernels.bench`. Block tables are random permutations of the physical
blocks (never contiguous), sequences may share their leading blocks (as prefix caching makes them), and
table columns past a sequence's last block point at free blocks. With `poison_unused`, every cache slot
no sequence reads is NaN, so a kernel that reads past a context (or through a padding column) fails.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass
class PagedInputs:
    q: torch.Tensor               # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor         # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor    # int32 [num_seqs, max_blocks]
    context_lens: torch.Tensor    # int32 [num_seqs]
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    scale: float

    def decode_args(self) -> tuple:
        return self.q, self.k_cache, self.v_cache, self.block_tables, self.context_lens, self.scale

    def prefill_args(self) -> tuple:
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.query_start_loc,
                self.context_lens, self.scale)

    def finite(self) -> PagedInputs:
        """The same inputs with NaN cache slots zeroed. The references multiply masked-out V rows by
        zero, so they need finite slots past a context (the engine zero-fills its caches); the Triton
        kernels must never read those slots at all."""
        return dataclasses.replace(self, k_cache=self.k_cache.nan_to_num(), v_cache=self.v_cache.nan_to_num())


def build_block_tables(context_lens: list[int], block_size: int, *, shared_blocks: int = 0,
                       spare_blocks: int = 2, extra_columns: int = 1,
                       generator: torch.Generator | None = None) -> tuple[torch.Tensor, int]:
    """Random non-contiguous tables; the first `shared_blocks` logical blocks are one physical set for all.

    Returns (int32 tables, number of physical blocks). Columns past a sequence's need name spare blocks.
    """
    needed = [-(-n // block_size) for n in context_lens]
    shared = min([shared_blocks, *needed]) if needed else 0
    num_blocks = shared + sum(n - shared for n in needed) + spare_blocks
    perm = torch.randperm(num_blocks, generator=generator).tolist()
    shared_ids, free = perm[:shared], perm[shared:]
    width = max(needed, default=0) + extra_columns
    rows = []
    for n in needed:
        own, free = free[:n - shared], free[n - shared:]
        rows.append(shared_ids + own)
    spare = free or perm[:1]
    table = torch.tensor([row + [spare[i % len(spare)] for i in range(width - len(row))] for row in rows],
                         dtype=torch.int32).reshape(len(rows), width)
    return table, num_blocks


def make_paged_inputs(context_lens: list[int], q_lens: list[int] | None = None, *, num_q_heads: int,
                      num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype = torch.float32,
                      device: str | torch.device = "cpu", shared_blocks: int = 0, poison_unused: bool = False,
                      window: int | None = None, generator: torch.Generator | None = None) -> PagedInputs:
    """Random inputs: decode when `q_lens` is None (one new token per sequence), else chunked prefill.
    With `window` and `poison_unused`, positions no query's window reaches are poisoned too."""
    q_lens = [1] * len(context_lens) if q_lens is None else q_lens
    tables, num_blocks = build_block_tables(context_lens, block_size, shared_blocks=shared_blocks,
                                            generator=generator)
    # Draw where the generator lives (the CPU for the tests, the GPU for the benchmark's gigabytes).
    rand = dict(generator=generator, dtype=dtype, device=generator.device if generator else device)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, **rand).to(device)
    v_cache = torch.randn(shape, **rand).to(device)
    if poison_unused:
        used = torch.zeros(num_blocks * block_size, dtype=torch.bool)
        firsts = None
        if window is not None:  # the oldest position the first new token of each sequence still sees
            firsts = [max(0, c - q - window + 1) for c, q in zip(context_lens, q_lens, strict=True)]
        used[slots_of(tables, context_lens, block_size, firsts)] = True
        k_cache.view(-1, num_kv_heads, head_dim)[~used.to(device)] = float("nan")
        v_cache.view(-1, num_kv_heads, head_dim)[~used.to(device)] = float("nan")
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    index = dict(dtype=torch.int32, device=device)
    return PagedInputs(
        q=torch.randn(starts[-1], num_q_heads, head_dim, **rand).to(device), k_cache=k_cache, v_cache=v_cache,
        block_tables=tables.to(device), context_lens=torch.tensor(context_lens, **index),
        query_start_loc=torch.tensor(starts, **index), scale=head_dim ** -0.5,
    )


def slots_of(block_tables: torch.Tensor, context_lens: list[int], block_size: int,
             firsts: list[int] | None = None) -> torch.Tensor:
    """Cache slots of every position of every sequence (from `firsts[s]` on, when given), concatenated."""
    slots = []
    for s, n in enumerate(context_lens):
        pos = torch.arange(firsts[s] if firsts else 0, n)
        slots.append(block_tables[s].cpu().long()[pos // block_size] * block_size + pos % block_size)
    return torch.cat(slots) if slots else torch.zeros(0, dtype=torch.long)


def dense_attention(inputs: PagedInputs, window: int | None = None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Float64, per sequence, from first principles: the answer every kernel and reference must match.
    `window`: a query at position p sees p - window + 1 .. p; `softcap`: scores capped as cap * tanh(s / cap);
    `sinks` [num_q_heads]: per head, exp(sink) joins each softmax's denominator (and adds no value)."""
    q = inputs.q.cpu().double()
    k_cache, v_cache = inputs.k_cache.cpu().double(), inputs.v_cache.cpu().double()
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group = q.shape[1] // num_kv_heads
    starts, lens = inputs.query_start_loc.tolist(), inputs.context_lens.tolist()
    out = torch.zeros_like(q)
    for s, ctx in enumerate(lens):
        q_start, q_end = starts[s], starts[s + 1]
        if q_start == q_end:
            continue
        slots = slots_of(inputs.block_tables[s:s + 1], [ctx], block_size)
        k = k_cache.view(-1, num_kv_heads, head_dim)[slots].repeat_interleave(group, dim=1)  # [ctx, hq, d]
        v = v_cache.view(-1, num_kv_heads, head_dim)[slots].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[q_start:q_end], k) * inputs.scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(ctx - (q_end - q_start), ctx)[None, :, None]
        k_pos = torch.arange(ctx)[None, None, :]
        hidden = k_pos > q_pos
        if window is not None:
            hidden |= k_pos <= q_pos - window
        scores = scores.masked_fill(hidden, float("-inf"))
        if sinks is None:
            probs = scores.softmax(dim=-1)
        else:  # normalised by hand, not by a softmax over an extra column: a second derivation of the rule
            top = torch.maximum(scores.amax(dim=-1, keepdim=True), sinks.cpu().double()[:, None, None])
            e = (scores - top).exp()
            probs = e / (e.sum(dim=-1, keepdim=True) + (sinks.cpu().double()[:, None, None] - top).exp())
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v)
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN anywhere gives NaN (which fails any `<=` bound)."""
    out, ref = out.double().cpu(), ref.double().cpu()
    return float((out - ref).norm() / ref.norm())
