"""Prefix caching on the real model: a request whose first 512 tokens are cached computes at most one
block plus its suffix, and its output equals the uncached run."""

from __future__ import annotations

import random

import pytest

from services import LLM, SamplingParams

pytestmark = pytest.mark.slow


def test_cached_prefix_skips_prefill_and_keeps_output(smollm2_fp32):
    llm = smollm2_fp32
    rng = random.Random(2026)  # fixed: an exact-equality test must not depend on a lucky draw
    prefix = [rng.randrange(100, 49152) for _ in range(512)]
    warm = prefix + [rng.randrange(100, 49152) for _ in range(7)]
    probe = prefix + [rng.randrange(100, 49152) for _ in range(20)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm.generate([warm], params, use_tqdm=False)

    computed = []
    # Only the probe runs now: every scheduled chunk starting inside its prompt is prefill work.
    llm.step_hook = lambda core: computed.extend(
        len(s.token_ids) for s in core.last_output.sequences if s.start_pos < len(probe))
    cached_out = llm.generate([probe], params, use_tqdm=False)[0]
    llm.step_hook = None
    block = llm.core.info.block_size
    assert cached_out.num_cached_tokens >= 512 - block
    assert sum(computed) <= block + 20, f"prefill computed {sum(computed)} tokens"

    fresh = LLM(dtype="float32", enable_prefix_caching=False, num_kv_blocks=256)
    uncached_out = fresh.generate([probe], params, use_tqdm=False)[0]
    assert uncached_out.num_cached_tokens == 0
    assert cached_out.outputs[0].token_ids == uncached_out.outputs[0].token_ids
