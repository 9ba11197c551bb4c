"""GPU benchmark of the Triton paged-attention kernels: `python -m kernels.bench` (CUDA only, < 5 minutes).

1. Checks every kernel against its PyTorch reference on random bfloat16 inputs (relative error <= 1e-2;
   write_kv must match exactly), with mixed context lengths, GQA and shared blocks.
2. Measures the device's copy bandwidth once (bytes read + written by a 2 GiB device-to-device copy).
3. Times decode attention for batch 1, 8, 64, 256 x context 512, 4096, 32768 (skipping what does not fit
   in memory) and prefill chunks of 512 and 2048 tokens over 4096 cached tokens: 32 query heads, 8 KV
   heads, head dim 128, block size 16. Per shape: median kernel time (CUDA events after warm-up, input
   sets rotated so that together they exceed L2), bytes of KV the kernel must read, achieved bandwidth
   and its fraction of the copy bandwidth. Each timed output is also checked against the reference.
4. Sweeps the decode kernel's tile/warps/stages at the goal shape (batch 64, context 4096: >= 80% of copy
   bandwidth on an H200), as far as the time budget allows, and says whether the goal is met.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from dataclasses import dataclass

import torch

import kernels
from kernels.bench_timing import copy_bandwidth, l2_bytes, median_ms
from kernels.paged_inputs import dense_attention, make_paged_inputs, rel_err


@dataclass(frozen=True)
class BenchShape:
    """Attention geometry of a benchmark: query heads, KV heads, head dim, block size, dtype."""

    hq: int = 32
    hkv: int = 8
    head_dim: int = 128
    block_size: int = 16
    dtype: torch.dtype = torch.bfloat16

    def kv_bytes(self, tokens: int) -> int:
        return tokens * self.hkv * self.head_dim * 2 * self.dtype.itemsize  # K and V


GOAL_SHAPE = BenchShape()  # Llama-3.1-8B's attention (and Llama-3.2-1B's but head dim 64)
# Correctness shapes: the goal shape, GQA 3 with a 32-token block, no GQA; then context lengths
# around block edges, long contexts and (prefill) chunks of every kind.
CHECK_SHAPES = ((32, 8, 128, 16), (9, 3, 64, 32), (8, 8, 64, 16))
CHECK_LENS = (1, "bs-1", "bs", "bs+1", 1000, 5000, 300, 33)
CHECK_CHUNKS = (1, "bs-1", 3, 1, 700, 64, 0, 33)
BATCHES, CONTEXTS = (1, 8, 64, 256), (512, 4096, 32768)
PREFILL_CHUNKS, PREFILL_CACHED = (512, 2048), 4096
GOAL_BATCH, GOAL_CONTEXT, GOAL_FRACTION = 64, 4096, 0.80
TOL = 1e-2
CHECKED_SEQS = 4  # each timed output: this many sequences re-done by the reference


def rotations(nbytes: int, device: torch.device) -> int:
    """Input sets to cycle through so that together they are 3x the L2 cache."""
    return max(1, min(64, math.ceil(3 * l2_bytes(device) / nbytes)))


def fits(nbytes: int, device: torch.device) -> bool:
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info()
    return nbytes < 0.8 * free


def _lengths(spec: tuple, block_size: int, cap: int | None) -> list[int]:
    values = [{"bs-1": block_size - 1, "bs": block_size, "bs+1": block_size + 1}.get(x, x) for x in spec]
    return [min(v, cap) for v in values] if cap else values


def check_correctness(device: torch.device, dtype: torch.dtype = torch.bfloat16,
                      shapes: tuple = CHECK_SHAPES, max_len: int | None = None) -> list[dict]:
    """Random inputs of mixed shapes through each Triton kernel and its reference. Returns one row per
    check: name, relative error and max absolute error vs the reference (and vs float64 dense
    attention), and whether it is within TOL. `max_len` caps the context lengths (dry runs)."""
    from kernels.triton_decode import decode_attention
    rows = []

    def report(name: str, out: torch.Tensor, ref: torch.Tensor, dense: torch.Tensor | None = None) -> None:
        err = rel_err(out, ref)
        row = dict(name=name, rel_err=err, max_abs_err=float((out.double() - ref.double()).abs().max()),
                   dense_rel_err=None if dense is None else rel_err(out, dense), ok=err <= TOL)
        extra = "" if dense is None else f"  (vs float64 dense {row['dense_rel_err']:.2e})"
        print(f"  {'ok  ' if row['ok'] else 'FAIL'} {name}: rel err vs reference {err:.2e}, "
              f"max abs {row['max_abs_err']:.2e}{extra}")
        rows.append(row)

    for hq, hkv, d, bs in shapes:
        shape = dict(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs, dtype=dtype, device=device)
        lens = _lengths(CHECK_LENS, bs, max_len)
        chunks = [min(c, n) for c, n in zip(_lengths(CHECK_CHUNKS, bs, max_len), lens, strict=True)]
        name = f"hq={hq} hkv={hkv} d={d} bs={bs}"
        dec = make_paged_inputs(lens, shared_blocks=1, **shape)
        ref = kernels.decode_attention_ref(*dec.decode_args())
        report(f"decode {name}", kernels.decode_attention(*dec.decode_args()), ref, dense_attention(dec))
        report(f"decode, 7 splits {name}", decode_attention(*dec.decode_args(), num_splits=7, min_split_tokens=1),
               ref)
        pre = make_paged_inputs(lens, chunks, shared_blocks=1, **shape)
        report(f"prefill {name}", kernels.prefill_attention(*pre.prefill_args()),
               kernels.prefill_attention_ref(*pre.prefill_args()), dense_attention(pre))

    hq, hkv, d, bs = shapes[0]
    caches = [torch.randn(64, bs, hkv, d, device=device, dtype=dtype) for _ in range(2)]
    copies = [c.clone() for c in caches]
    slots = torch.randperm(64 * bs, device=device)[:300]
    slots[::7] = -1
    k, v = (torch.randn(300, hkv, d, device=device, dtype=dtype) for _ in range(2))
    kernels.write_kv(k, v, *caches, slots)
    kernels.write_kv_ref(k, v, *copies, slots)
    exact = all(torch.equal(a, b) for a, b in zip(caches, copies, strict=True))
    rows.append(dict(name="write_kv (must be exact)", rel_err=0.0 if exact else math.inf,
                     max_abs_err=float(max((a.double() - b.double()).abs().max() for a, b in zip(caches, copies,
                                                                                               strict=True))),
                     dense_rel_err=None, ok=exact))
    print(f"  {'ok  ' if exact else 'FAIL'} write_kv (must be exact)")
    return rows


def bench_decode(batch: int, ctx: int, device: torch.device, reps: int, shape: BenchShape = GOAL_SHAPE,
                 **knobs) -> dict | None:
    from kernels.triton_decode import plan_decode_attention
    nbytes = shape.kv_bytes(batch * ctx)
    sets = rotations(nbytes, device)
    if not fits(sets * nbytes * 1.05, device):
        return None
    inp = make_paged_inputs([ctx] * (batch * sets), num_q_heads=shape.hq, num_kv_heads=shape.hkv,
                            head_dim=shape.head_dim, block_size=shape.block_size, dtype=shape.dtype, device=device)
    runs = []
    for r in range(sets):
        rows = slice(r * batch, (r + 1) * batch)
        runs.append(plan_decode_attention(inp.q[rows], inp.k_cache, inp.v_cache, inp.block_tables[rows],
                                          inp.context_lens[rows], inp.scale, max_context_len=ctx, **knobs))
    ms = median_ms(runs, reps=reps, device=device)
    n = min(batch, CHECKED_SEQS)
    out = runs[0]()[:n]
    ref = kernels.decode_attention_ref(inp.q[:n], inp.k_cache, inp.v_cache, inp.block_tables[:n],
                                       inp.context_lens[:n], inp.scale)
    return dict(kernel="decode", batch=batch, context=ctx, ms=ms, kv_bytes=nbytes, input_sets=sets,
                rel_err=rel_err(out, ref), **knobs)


def bench_sdpa_decode(batch: int, ctx: int, device: torch.device, reps: int,
                      shape: BenchShape = GOAL_SHAPE) -> dict | None:
    """torch's scaled_dot_product_attention on contiguous KV of the same size: the roofline stand-in
    that paged decode is judged against (same bytes, no block-table indirection)."""
    import torch.nn.functional as F
    nbytes = shape.kv_bytes(batch * ctx)
    sets = rotations(nbytes, device)
    if not fits(sets * nbytes * 1.05, device):
        return None
    gen = dict(device=device, dtype=shape.dtype)
    inputs = [(torch.randn(batch, shape.hq, 1, shape.head_dim, **gen),
               torch.randn(batch, shape.hkv, ctx, shape.head_dim, **gen),
               torch.randn(batch, shape.hkv, ctx, shape.head_dim, **gen)) for _ in range(sets)]
    gqa = shape.hq != shape.hkv
    runs = [lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa) for q, k, v in inputs]
    ms = median_ms(runs, reps=reps, device=device)
    return dict(kernel="sdpa", batch=batch, context=ctx, ms=ms, kv_bytes=nbytes, input_sets=sets, rel_err=0.0)


def bench_prefill(chunk: int, device: torch.device, reps: int, shape: BenchShape = GOAL_SHAPE,
                  cached: int = PREFILL_CACHED) -> dict | None:
    from kernels.triton_prefill import plan_prefill_attention
    ctx = cached + chunk
    nbytes = shape.kv_bytes(ctx)
    sets = rotations(nbytes, device)
    if not fits(sets * nbytes * 1.05, device):
        return None
    inp = make_paged_inputs([ctx] * sets, [chunk] * sets, num_q_heads=shape.hq, num_kv_heads=shape.hkv,
                            head_dim=shape.head_dim, block_size=shape.block_size, dtype=shape.dtype, device=device)
    starts = torch.tensor([0, chunk], dtype=torch.int32, device=device)
    runs = [plan_prefill_attention(inp.q[r * chunk:(r + 1) * chunk], inp.k_cache, inp.v_cache,
                                   inp.block_tables[r:r + 1], starts, inp.context_lens[r:r + 1], inp.scale,
                                   max_query_len=chunk, max_context_len=ctx)
            for r in range(sets)]
    ms = median_ms(runs, reps=reps, device=device)
    ref = kernels.prefill_attention_ref(inp.q[:chunk], inp.k_cache, inp.v_cache, inp.block_tables[:1], starts,
                                        inp.context_lens[:1], inp.scale)
    pairs = chunk * cached + chunk * (chunk + 1) // 2  # (query, key) pairs under the causal mask
    return dict(kernel="prefill", batch=1, context=ctx, chunk=chunk, ms=ms, kv_bytes=nbytes, input_sets=sets,
                rel_err=rel_err(runs[0](), ref),
                tflops=4 * shape.hq * shape.head_dim * pairs / (ms * 1e-3) / 1e12)


def print_row(row: dict, copy_bw: float) -> None:
    bw = row["kv_bytes"] / (row["ms"] * 1e-3)
    row.update(gb_per_s=bw / 1e9, copy_fraction=bw / copy_bw)
    shape = f"{row['kernel']:7s} b={row['batch']:<3d} ctx={row['context']:<6d}"
    if "chunk" in row:
        shape += f" chunk={row['chunk']}"
    knobs = " ".join(f"{k}={row[k]}" for k in ("tile_n", "num_warps", "num_stages") if k in row)
    extra = f"  {row['tflops']:.0f} TFLOP/s" if "tflops" in row else ""
    flag = "" if row["rel_err"] <= TOL else "  REL ERR TOO HIGH"
    print(f"  {shape:34s} {row['ms'] * 1e3:9.1f} us  KV {row['kv_bytes'] / 1e6:9.1f} MB  "
          f"{bw / 1e9:7.0f} GB/s  {100 * bw / copy_bw:5.1f}% of copy  err {row['rel_err']:.1e}{extra}"
          f"{'  ' + knobs if knobs else ''}{flag}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30, help="timed calls per shape (median reported)")
    parser.add_argument("--budget-s", type=float, default=270, help="start no measurement after this long")
    parser.add_argument("--no-sweep", action="store_true", help="skip the decode tile/warps/stages sweep")
    parser.add_argument("--json", help="also write every measured row to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernels.bench needs a CUDA device; on the CPU run the interpreter tests: pytest tests/kernels")
        return 2
    deadline = time.monotonic() + args.budget_s
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    import triton
    print(f"{props.name}: {props.multi_processor_count} SMs, L2 {l2_bytes(device) / 2**20:.0f} MiB, "
          f"{props.total_memory / 2**30:.0f} GiB; torch {torch.__version__}, triton {triton.__version__}")
    print("correctness (bfloat16):")
    failures = [r["name"] for r in check_correctness(device) if not r["ok"]]
    copy_bw = copy_bandwidth(device)
    print(f"copy bandwidth: {copy_bw / 1e9:.0f} GB/s (read + write)")

    rows: list[dict] = []
    g = GOAL_SHAPE
    print(f"decode: {g.hq} query heads, {g.hkv} KV heads, head dim {g.head_dim}, block size {g.block_size}, {g.dtype}")
    jobs = [("decode", b, c) for b, c in itertools.product(BATCHES, CONTEXTS)]
    jobs += [("prefill", 1, chunk) for chunk in PREFILL_CHUNKS]
    for kind, batch, size in jobs:
        if time.monotonic() > deadline:
            print(f"  {kind} b={batch} {size}: skipped (time budget)")
            continue
        if kind == "decode":
            row = bench_decode(batch, size, device, args.reps)
        else:
            row = bench_prefill(size, device, args.reps)
        torch.cuda.empty_cache()
        if row is None:
            print(f"  {kind} b={batch} {size}: skipped (does not fit in memory)")
            continue
        print_row(row, copy_bw)
        rows.append(row)
        failures += [f"{kind} b={batch} {size}"] if row["rel_err"] > TOL else []

    if not args.no_sweep:
        print(f"decode sweep at batch {GOAL_BATCH}, context {GOAL_CONTEXT}:")
        for tile_n, warps, stages in itertools.product((32, 64, 128), (4, 8), (2, 3, 4)):
            if time.monotonic() > deadline:
                print("  rest of sweep skipped (time budget)")
                break
            row = bench_decode(GOAL_BATCH, GOAL_CONTEXT, device, args.reps, tile_n=tile_n, num_warps=warps,
                               num_stages=stages)
            print_row(row, copy_bw)
            rows.append(row)

    goal_key = ("decode", GOAL_BATCH, GOAL_CONTEXT)
    goal = [r for r in rows if (r["kernel"], r["batch"], r["context"]) == goal_key]
    default = [r for r in goal if "tile_n" not in r]
    if default:
        fraction = default[0]["copy_fraction"]
        best = max(goal, key=lambda r: r["copy_fraction"])
        print(f"goal (decode b={GOAL_BATCH} ctx={GOAL_CONTEXT} >= {GOAL_FRACTION:.0%} of copy bandwidth): "
              f"{'MET' if fraction >= GOAL_FRACTION else 'NOT MET'} with default settings ({fraction:.1%}); "
              f"best of sweep {best['copy_fraction']:.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=props.name, copy_bandwidth=copy_bw, rows=rows, failures=failures), f,
                      indent=1)
    print("FAILURES: " + ", ".join(failures) if failures else "all checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
