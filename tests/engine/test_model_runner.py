"""The model runner under the scheduler core: prefix caching on the real model (a request whose first
512 tokens are cached computes at most one block plus its suffix, and its output equals the uncached
run), and a step failure tied to one request on a tiny model (the others' tokens do not change)."""

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


class _PoisonOne:
    """The real engine, except that any step holding one chosen request's sequences raises."""

    def __init__(self, inner, poison_prefix: str):
        self.inner, self.poison = inner, poison_prefix

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def execute(self, out):
        if any(s.seq_id.startswith(self.poison) for s in out.sequences):
            raise RuntimeError("injected failure tied to one request")
        return self.inner.execute(out)


def test_a_failure_tied_to_one_request_leaves_the_others_tokens_unchanged(tiny_model_dir):
    prompts = [[100 + 7 * i + j for j in range(20 + 9 * i)] for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    clean = LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=48)
    want = [o.outputs[0].token_ids for o in clean.generate(prompts, params, use_tqdm=False)]
    llm = LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=48)
    llm.core.executor = _PoisonOne(llm.core.executor, "offline-2")
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert outs[2].error_kind == "request" and outs[2].outputs[0].finish_reason == "error"
    assert [o.outputs[0].token_ids for i, o in enumerate(outs) if i != 2] == want[:2] + want[3:]
    assert llm.core.pool.num_in_use == 0
