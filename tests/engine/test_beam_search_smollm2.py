"""Beam search on the real SmolLM2-135M (float32) equals transformers' `generate(num_beams=W,
do_sample=False)` on the same weights: widths 2 and 4, each length-penalty / early-stopping convention,
first alone, then beside ordinary requests in a KV pool small enough to preempt the beams, with every
block back in the pool at the end.
"""

from __future__ import annotations

import pytest

from services import LLM, BeamSearchParams, SamplingParams
from tests.engine.conftest import hf_greedy

pytestmark = pytest.mark.slow

EOS = 2  # SmolLM2's <|im_end|> / end of text, also its pad token
MAX_TOKENS = 10
GREEDY_TOKENS = 24


def _prompts(tok) -> list[list[int]]:
    return [tok.encode("The capital of France is"),
            tok.apply_chat_template([{"role": "user", "content": "Name three colours."}]),
            tok.encode("def fibonacci(n):")]


def hf_beams(model, prompt: list[int], width: int, length_penalty: float, early_stopping) -> list[list[int]]:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), num_beams=width, do_sample=False, num_return_sequences=width,
                             max_new_tokens=MAX_TOKENS, length_penalty=length_penalty,
                             early_stopping=early_stopping, eos_token_id=EOS, pad_token_id=EOS)
    beams = []
    for row in out.tolist():
        gen = row[len(prompt):]
        beams.append(gen[:gen.index(EOS) + 1] if EOS in gen else gen)  # what follows EOS is padding
    return beams


@pytest.mark.parametrize("width,length_penalty,early_stopping", [(2, 1.0, False), (4, 0.5, True), (4, 1.5, "never")])
def test_beam_search_equals_transformers(smollm2_fp32, hf_smollm2, width, length_penalty, early_stopping):
    llm = smollm2_fp32
    prompts = _prompts(llm.tokenizer)
    params = BeamSearchParams(beam_width=width, max_tokens=MAX_TOKENS, length_penalty=length_penalty,
                              early_stopping=early_stopping)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for p, out in zip(prompts, outs, strict=True):
        assert len(out.sequences) == width
        assert [s.output_token_ids for s in out.sequences] == hf_beams(hf_smollm2, p, width, length_penalty,
                                                                         early_stopping)
        for s in out.sequences:
            assert s.tokens == p + s.output_token_ids
            assert s.finish_reason == ("stop" if s.output_token_ids[-1] == EOS else "length")
    assert llm.core.pool.num_in_use == 0


def test_beams_beside_ordinary_requests_under_preemption(hf_smollm2):
    """A beam search (width 4) beside a greedy request in a pool of 10 blocks of 16 tokens: the beams are
    preempted and recomputed, and both still equal transformers run alone."""
    llm = LLM(dtype="float32", num_kv_blocks=10, max_num_batched_tokens=64, enable_prefix_caching=True)
    tok = llm.tokenizer
    prompts = _prompts(tok)[:1]
    greedy_prompts = [tok.encode("Once upon a time, " * 20)]
    for i, p in enumerate(greedy_prompts):
        llm.core.add_request(f"g{i}", p, SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True))
    beam = BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS).to_sampling_params()
    for i, p in enumerate(prompts):
        llm.core.add_request(f"b{i}", p, beam)
    done, beams_preempted = {}, False
    while llm.core.has_unfinished():
        for out in llm.core.step():
            if out.finished:
                done[out.request_id] = out
        llm.core.pool.check_invariants()
        beams_preempted |= any(s.request_id[0] == "b" and s.num_preemptions for s in llm.core.scheduler.waiting)
    assert set(done) == {"g0", "b0"}
    assert beams_preempted
    assert llm.core.pool.num_in_use == 0 and llm.core.pool.num_free == llm.core.pool.num_blocks
    for i, p in enumerate(greedy_prompts):
        assert done[f"g{i}"].outputs[0].token_ids == hf_greedy(hf_smollm2, p, GREEDY_TOKENS)
    for i, p in enumerate(prompts):
        assert [c.token_ids for c in done[f"b{i}"].outputs] == hf_beams(hf_smollm2, p, 4, 1.0, False)
