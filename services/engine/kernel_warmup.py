"""Kernel warm-up at engine start: every Triton kernel variant a serving step can launch compiles before the
engine says ready, not on a live request (0.5-1 s each on a GPU).

Triton compiles one variant per specialization of a kernel's constexprs (the prefill tile of 64 or 128
rows, split-KV decode or not) and of its arguments' alignment; the step buffer keeps every index field
16-byte aligned (step_layout.FIELD_ALIGN) and the kernels do not specialize on what varies per step
(kernels/triton_*.py: `do_not_specialize`), so a handful of synthetic steps covers them: prefill-only,
decode-only and mixed, short and split-KV decodes, small and large prefill tiles, and on CUDA structured
output's token mask. Decode-graph shapes warm at graph capture. Every rank of a tensor-parallel engine
runs the same steps (their collectives pair up). tests/engine/test_kernel_warmup.py proves the set is
closed over a varied run of steps.
"""

from __future__ import annotations

import logging
import time

import torch

from services.contracts.step_protocol import SamplingSpec, ScheduledSequence, SchedulerOutput

log = logging.getLogger(__name__)


def warmup_outputs(num_q_heads: int, num_kv_heads: int, block_size: int, max_model_len: int, num_kv_blocks: int,
                   sms: int, num_groups: int = 1) -> list[SchedulerOutput]:
    """The synthetic steps: each sequence on its own blocks (in every KV group), tokens 0, nothing sampled."""
    from kernels.triton_common import next_pow2
    from kernels.triton_decode import MIN_SPLIT_TOKENS

    block_g = next_pow2(num_q_heads // num_kv_heads)
    tile_tokens = max(2, 128 // block_g)  # the tokens of one 128-row prefill tile
    big = [tile_tokens] * -(-sms // num_kv_heads)  # enough tiles for every multiprocessor: 128 rows
    small = [2]  # one program per KV head: 64 rows (where that leaves multiprocessors idle)
    long_ctx = min(max_model_len, 2 * MIN_SPLIT_TOKENS + 1)  # long enough to split the KV
    shapes = [([], small), ([], big), ([2], []), ([long_ctx], []), ([2, long_ctx], small), ([2], big),
              ([long_ctx], big)]
    outs = []
    for step_id, (decodes, prefills) in enumerate(shapes, start=1):
        seqs, next_block = [], 0
        for kind, lengths in (("d", decodes), ("p", prefills)):
            for i, n in enumerate(lengths):
                blocks = -(-n // block_size)
                if next_block + blocks * num_groups > num_kv_blocks:
                    break
                tables = [list(range(next_block + g * blocks, next_block + (g + 1) * blocks))
                          for g in range(num_groups)]
                next_block += blocks * num_groups
                tokens, start = ([0], n - 1) if kind == "d" else ([0] * n, 0)
                seqs.append(ScheduledSequence(f"warmup-{kind}{i}", tokens, start, tables[0], False, SamplingSpec(),
                                              group_block_tables=tables[1:]))
        if seqs:
            outs.append(SchedulerOutput(-step_id, seqs))
    return outs


@torch.inference_mode()
def warm_up(runner) -> None:
    """Run the warm-up steps' forwards on `runner` (before graph capture), then clear the KV cache."""
    from kernels.triton_common import num_sms

    started = time.monotonic()
    model = runner.model
    outs = warmup_outputs(model.num_heads, model.num_kv_heads, runner.block_size, runner.max_model_len,
                          runner.num_kv_blocks, num_sms(runner.device), runner.kv_plan.num_groups)
    for out in outs:
        runner.run_step(runner.inputs.build(out))
    runner.arena.zero_()
    if runner.device.type == "cuda":
        # Structured output's mask: float32 logits (sampled rows) and the model's dtype (greedy rows).
        from kernels.triton_token_bitmask import apply_token_bitmask

        vocab = model.config.vocab_size
        mask = torch.full((1, -(-vocab // 32)), -1, dtype=torch.int32, device=runner.device)
        for dtype in {torch.float32, runner.dtype}:
            apply_token_bitmask(torch.zeros(1, vocab, dtype=dtype, device=runner.device), mask)
        torch.cuda.synchronize(runner.device)
    log.info("warmed the attention kernels with %d steps in %.1f s", len(outs), time.monotonic() - started)
