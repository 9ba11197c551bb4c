"""Input validation shared by the Triton launchers and the PyTorch references.

Structural checks (rank, dtype, head counts, devices, strides) read only tensor metadata, so they cost
microseconds and run on every call of every entry point. Value checks (a context longer than its block
table, query offsets out of order, slots outside the cache) need the index tensors' contents; the
launchers do them with one host read per call, which they need anyway to size the grid. Every failure
raises `TypeError` (dtype, device, type) or `ValueError` (shape, value) naming the entry point and the
argument, so a caller never gets a silent wrong answer.
"""

from __future__ import annotations

import numbers

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# A KV cache may also hold float8_e4m3fn (an FP8 cache: per-tensor scales applied by the caller).
CACHE_DTYPES = (*FLOAT_DTYPES, torch.float8_e4m3fn)
INDEX_DTYPES = (torch.int32, torch.int64)


def _tensor(op: str, name: str, t, rank: int, dtypes: tuple[torch.dtype, ...]) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != rank:
        raise ValueError(f"{op}: {name} must have rank {rank}, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{op}: {name} must have dtype {allowed}; got {str(t.dtype).removeprefix('torch.')}")


def _same_device(op: str, **tensors: torch.Tensor) -> None:
    # get_device() (-1 for the CPU, else the CUDA index) is the cheap test: the refs run it on every call.
    index = next(iter(tensors.values())).get_device()
    for t in tensors.values():
        if t.get_device() != index:
            listing = ", ".join(f"{name} on {t.device}" for name, t in tensors.items())
            raise TypeError(f"{op}: all tensors must be on one device; got {listing}")


def _unit_last_stride(op: str, **tensors: torch.Tensor) -> None:
    # Kernels address rows through strides but read each head vector as one contiguous run.
    for name, t in tensors.items():
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{op}: {name} must have stride 1 in its last dimension; "
                             f"got strides {t.stride()}")


def _caches(op: str, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    _tensor(op, "k_cache", k_cache, 4, CACHE_DTYPES)
    _tensor(op, "v_cache", v_cache, 4, CACHE_DTYPES)
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"{op}: k_cache and v_cache must match; got {tuple(k_cache.shape)} {k_cache.dtype} "
                         f"and {tuple(v_cache.shape)} {v_cache.dtype}")


def _query(op: str, q: torch.Tensor, k_cache: torch.Tensor) -> None:
    _tensor(op, "q", q, 3, FLOAT_DTYPES)
    if q.dtype != k_cache.dtype and k_cache.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{op}: q has dtype {q.dtype} but the KV cache holds {k_cache.dtype}")
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, cache_head_dim = k_cache.shape[2], k_cache.shape[3]
    if head_dim != cache_head_dim:
        raise ValueError(f"{op}: q head_dim {head_dim} != KV cache head_dim {cache_head_dim}")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"{op}: q has {num_q_heads} heads, not a multiple of the cache's "
                         f"{num_kv_heads} KV heads")


def _scale(op: str, scale) -> None:
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"{op}: scale must be a Python number, got {type(scale).__name__}")


def check_write_kv(op: str, k, v, k_cache, v_cache, slot_mapping) -> None:
    """Structural checks for write_kv."""
    _caches(op, k_cache, v_cache)
    _tensor(op, "k", k, 3, CACHE_DTYPES)
    _tensor(op, "v", v, 3, CACHE_DTYPES)
    _tensor(op, "slot_mapping", slot_mapping, 1, INDEX_DTYPES)
    _same_device(op, k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    want = (slot_mapping.shape[0], k_cache.shape[2], k_cache.shape[3])
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape) != want:
            raise ValueError(f"{op}: {name} must be [num_tokens, num_kv_heads, head_dim] = {list(want)} "
                             f"to match slot_mapping and the cache; got {list(t.shape)}")
        if t.dtype != k_cache.dtype:
            raise TypeError(f"{op}: {name} has dtype {t.dtype} but the KV cache holds {k_cache.dtype}")


def _tables(op: str, block_tables, context_lens, scale, num_seqs: int) -> None:
    _tensor(op, "block_tables", block_tables, 2, INDEX_DTYPES)
    _tensor(op, "context_lens", context_lens, 1, INDEX_DTYPES)
    _scale(op, scale)
    if block_tables.shape[0] != num_seqs or context_lens.shape[0] != num_seqs:
        raise ValueError(f"{op}: expected {num_seqs} sequences; block_tables has {block_tables.shape[0]} "
                         f"rows and context_lens {context_lens.shape[0]} entries")


def check_decode(op: str, q, k_cache, v_cache, block_tables, context_lens, scale) -> None:
    """Structural checks for decode attention."""
    _caches(op, k_cache, v_cache)
    _query(op, q, k_cache)
    _tables(op, block_tables, context_lens, scale, num_seqs=q.shape[0])
    _same_device(op, q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                 context_lens=context_lens)


def check_prefill(op: str, q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale) -> None:
    """Structural checks for prefill attention."""
    _caches(op, k_cache, v_cache)
    _query(op, q, k_cache)
    _tensor(op, "query_start_loc", query_start_loc, 1, INDEX_DTYPES)
    if query_start_loc.shape[0] == 0:
        raise ValueError(f"{op}: query_start_loc must have num_seqs + 1 >= 1 entries, got 0")
    _tables(op, block_tables, context_lens, scale, num_seqs=query_start_loc.shape[0] - 1)
    _same_device(op, q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                 query_start_loc=query_start_loc, context_lens=context_lens)


def check_options(op: str, window, softcap, sinks=None, q: torch.Tensor | None = None) -> None:
    """The attention options (kernels.reference): a window of >= 1 positions, a positive soft-cap, and
    sinks as one float32 logit per query head of `q`, on q's device, contiguous (the kernels index them by
    head). Metadata only: no value is read, so a sink's value (even -inf: no sink) is the caller's."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"{op}: window must be None or an integer >= 1, got {window!r}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, numbers.Real)
                                or not softcap > 0):
        raise ValueError(f"{op}: softcap must be None or a number > 0, got {softcap!r}")
    if sinks is None:
        return
    _tensor(op, "sinks", sinks, 1, (torch.float32,))
    if q is not None:
        if sinks.shape[0] != q.shape[1]:
            raise ValueError(f"{op}: sinks must hold one logit per query head ({q.shape[1]}); "
                             f"got shape {tuple(sinks.shape)}")
        _same_device(op, q=q, sinks=sinks)
    if sinks.numel() > 1 and sinks.stride(0) != 1:
        raise ValueError(f"{op}: sinks must be contiguous; got stride {sinks.stride()}")


def check_strides(op: str, **tensors: torch.Tensor) -> None:
    """Launcher-only: the Triton kernels need unit stride in the last dimension (and in 1-D index tensors)."""
    _unit_last_stride(op, **tensors)


def check_context_fits(op: str, min_len: int, max_len: int, block_tables: torch.Tensor, block_size: int,
                       *, min_allowed: int = 1) -> None:
    """A context must be at least `min_allowed` long and fit in its block table row."""
    if min_len < min_allowed:
        raise ValueError(f"{op}: context_lens must be >= {min_allowed}; got {min_len}")
    capacity = block_tables.shape[1] * block_size
    if max_len > capacity:
        raise ValueError(f"{op}: block table too short: a context of {max_len} tokens needs "
                         f"{-(-max_len // block_size)} blocks of {block_size}, but block_tables has "
                         f"{block_tables.shape[1]} columns")


def check_query_layout(op: str, starts: list[int], lens: list[int], num_tokens: int) -> None:
    """query_start_loc runs from 0 to num_tokens without going back; no chunk outgrows its context."""
    if starts[0] != 0 or starts[-1] != num_tokens:
        raise ValueError(f"{op}: query_start_loc must start at 0 and end at num_tokens={num_tokens}; "
                         f"got {starts[0]} .. {starts[-1]}")
    for s, ctx in enumerate(lens):
        q_len = starts[s + 1] - starts[s]
        if q_len < 0:
            raise ValueError(f"{op}: query_start_loc decreases at sequence {s}: "
                             f"{starts[s]} -> {starts[s + 1]}")
        if q_len > ctx:
            raise ValueError(f"{op}: sequence {s} has {q_len} new tokens but context_lens[{s}] = {ctx}; the "
                             f"context counts the new tokens too")


def check_slots(op: str, min_slot: int, max_slot: int, k_cache: torch.Tensor) -> None:
    """Slots are -1 (padding) or inside the cache."""
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    if min_slot < -1 or max_slot >= num_slots:
        raise ValueError(f"{op}: slot_mapping must hold -1 (skip) or slots in [0, {num_slots}); "
                         f"got values in [{min_slot}, {max_slot}]")
