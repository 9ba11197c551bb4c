"""CPU micro-benchmark of the fused expert computation: `python -m kernels.bench_moe [--tokens 1 8 64 512]`.

Per token count, bfloat16, random top-k routing (distinct experts per token): the median time of
fused_experts_cpu over weights packed for each CPU GEMM (bf16_gemm "avx512" where built, oneDNN
reordered, plain F.linear) and of the reference (a loop over all E experts, gate and up as separate
products); each fast result is checked against the reference first. Default shape: Qwen3-30B-A3B's
expert (H 2048, I 768, top-8) with 32 experts instead of 128, so the weights fit a small machine (the
work per token does not depend on E, only the number of active experts does).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kernels.moe_cpu import fused_experts_cpu, pack_experts_cpu
from kernels.moe_reference import fused_experts_ref


def _median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=768)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--activation", default="silu")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    e, h, i = args.experts, args.hidden, args.inter
    w_gate_up = (torch.randn(e, 2 * i, h, generator=g) / h ** 0.5).bfloat16()
    w_down = (torch.randn(e, h, i, generator=g) / i ** 0.5).bfloat16()
    packs = {}
    for gemm in ("avx512", "onednn", "linear"):
        try:
            packs[gemm] = pack_experts_cpu(w_gate_up, w_down, gemm=gemm)
        except ValueError as err:  # no AVX512-BF16 build here
            print(f"# {gemm}: {err}")
    print(f"# H={h} I={i} E={e} K={args.top_k} bfloat16, {torch.get_num_threads()} threads; median ms per call")
    print("tokens | active experts | " + " | ".join(f"{k} ({p.kind})" for k, p in packs.items()) + " | reference")
    for t in args.tokens:
        x = torch.randn(t, h, generator=g).bfloat16()
        ids = torch.rand(t, e, generator=g).argsort(dim=1)[:, :args.top_k]
        weights = torch.rand(t, args.top_k, generator=g)
        print(_row(x, w_gate_up, w_down, ids, weights, packs, args))


def _row(x, w_gate_up, w_down, ids, weights, packs, args) -> str:
    want = fused_experts_ref(x, w_gate_up, w_down, ids, weights, args.activation)
    scale = want.float().abs().max().item()
    cells = []
    for pack in packs.values():
        def call(p=pack):
            return fused_experts_cpu(x, None, None, ids, weights, args.activation, packed=p)

        assert (call().float() - want.float()).abs().max().item() <= 2 ** -5 * scale, "fast path disagrees"
        cells.append(f"{_median_ms(call, args.reps):.2f}")
    ref_ms = _median_ms(lambda: fused_experts_ref(x, w_gate_up, w_down, ids, weights, args.activation),
                        max(1, args.reps // 3))
    return f"{x.shape[0]} | {int(ids.unique().numel())} | " + " | ".join(cells) + f" | {ref_ms:.2f}"

if __name__ == "__main__":
    main()
