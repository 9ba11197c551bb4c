"""Logit bias, repetition/frequency/presence penalties and min_p, batched, against a float64 reference of
the same rule written the plain way (a loop over the tokens a row has seen); and the sampler around them:
rows without them are sampled exactly as before, log-probabilities stay the model's."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services import SamplingParams
from services.contracts.step_protocol import PenaltySpec, SamplingSpec
from services.engine.logits_processors import apply_min_p, apply_penalties
from services.engine.sampler import Sampler, SampleRow

VOCAB = 97


def reference_penalties(logits: torch.Tensor, spec: PenaltySpec) -> torch.Tensor:
    """vLLM's rule in float64, token by token."""
    out = logits.double().clone()
    for t, b in zip(spec.bias_token_ids, spec.bias_values, strict=True):
        out[t] += b
    counts = Counter(spec.output_token_ids)
    if spec.repetition_penalty != 1.0:
        for t in set(spec.prompt_token_ids) | set(counts):
            r = spec.repetition_penalty
            out[t] = out[t] / r if out[t] > 0 else out[t] * r
    for t, c in counts.items():
        out[t] -= spec.frequency_penalty * c + spec.presence_penalty
    return out


token = st.integers(0, VOCAB - 1)
specs = st.builds(
    lambda pres, freq, rep, bias, out, prompt: PenaltySpec(
        pres, freq, rep, 0.0, list(bias), list(bias.values()), out, sorted(set(prompt)) if rep != 1.0 else []),
    st.sampled_from([0.0, 0.5, -1.25, 2.0]), st.sampled_from([0.0, 0.3, -2.0, 1.7]),
    st.sampled_from([1.0, 1.3, 0.7, 100.0, 0.01]),
    st.dictionaries(token, st.floats(-100, 100, allow_nan=False), max_size=6),
    st.lists(token, max_size=30), st.lists(token, max_size=30))


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(specs, min_size=1, max_size=5), seed=st.integers(0, 2**16))
def test_penalties_equal_the_float64_reference(rows, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(rows), VOCAB, generator=g) * 4
    got = apply_penalties(logits.clone(), rows)
    for i, spec in enumerate(rows):
        ref = reference_penalties(logits[i], spec)
        torch.testing.assert_close(got[i].double(), ref, rtol=1e-6, atol=1e-4)


def test_min_p_keeps_exactly_the_tokens_above_the_threshold():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, VOCAB, generator=g) * 3
    min_ps = [0.0, 0.1, 1.0]
    got = apply_min_p(logits.clone(), min_ps)
    for i, m in enumerate(min_ps):
        p = torch.softmax(logits[i].double(), -1)
        keep = p >= m * p.max()
        assert torch.equal(torch.isfinite(got[i]), keep)
        assert torch.equal(got[i][keep], logits[i][keep])


def _rows(specs_, temperature=0.0, seed=None, logprobs=None):
    return [SampleRow(SamplingSpec(temperature=temperature, seed=seed, logprobs=logprobs), 0, 0, penalties=s)
            for s in specs_]


def test_greedy_rows_take_the_argmax_of_the_adjusted_logits_and_others_are_untouched():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, VOCAB, generator=g)
    top = logits[1].argmax().item()
    spec = PenaltySpec(presence_penalty=2.0, frequency_penalty=2.0, output_token_ids=[top, top])
    bias = PenaltySpec(bias_token_ids=[7], bias_values=[100.0])
    only_min_p = PenaltySpec(min_p=0.9)  # never moves a greedy argmax
    rows = _rows([None, spec, bias, only_min_p])
    tokens, lps = Sampler(torch.device("cpu"))(logits.clone(), rows)
    assert tokens[0] == logits[0].argmax().item() and tokens[3] == logits[3].argmax().item()
    assert tokens[1] == reference_penalties(logits[1], spec).argmax().item() != top
    assert tokens[2] == 7
    assert lps == [None] * 4


def test_log_probabilities_are_the_models_and_seeded_draws_follow_the_adjusted_distribution():
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(1, VOCAB, generator=g) * 2
    spec = PenaltySpec(repetition_penalty=1.5, frequency_penalty=0.4, min_p=0.2, bias_token_ids=[3],
                       bias_values=[4.0], output_token_ids=[1, 1, 5], prompt_token_ids=[2, 9])
    sampler = Sampler(torch.device("cpu"))
    rows = [SampleRow(SamplingSpec(temperature=0.9, logprobs=2), 0, i, penalties=spec) for i in range(400)]
    tokens, lps = sampler(logits.expand(400, VOCAB).contiguous(), rows)
    raw = torch.log_softmax(logits[0].double(), -1)
    assert abs(lps[0].logprob - raw[tokens[0]].item()) < 1e-5  # raw: what the model gave, as vLLM's default
    p = torch.softmax(reference_penalties(logits[0], spec) / 0.9, -1)
    allowed = set((p >= 0.2 * p.max()).nonzero().flatten().tolist())
    assert set(tokens) <= allowed and len(set(tokens)) > 1
    # The same seed, sample and output index draw the same token whatever else is in the batch.
    row = SampleRow(SamplingSpec(temperature=0.9, seed=123), 2, 4, penalties=spec)
    alone, _ = sampler(logits.clone(), [row])
    crowd, _ = sampler(torch.cat([torch.randn(2, VOCAB), logits]), _rows([None, None], 1.0) + [row])
    assert alone[0] == crowd[2]


@pytest.mark.slow
def test_repetition_penalty_and_bias_on_smollm2_equal_transformers(smollm2_fp32, hf_smollm2):
    """Fidelity on the real model: transformers' RepetitionPenaltyLogitsProcessor is the same rule (over
    prompt + output), and its sequence_bias on single tokens is logit_bias."""
    prompt = smollm2_fp32.tokenizer.encode("List the colours: red, red, red, red, red, red,")
    comma = smollm2_fp32.tokenizer.encode(",")[-1]

    def ours(**kw):
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, **kw)
        return smollm2_fp32.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids

    def theirs(**kw):
        with torch.no_grad():
            out = hf_smollm2.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                                      pad_token_id=0, **kw)
        return out[0, len(prompt):].tolist()

    penalized = ours(repetition_penalty=1.4)
    assert penalized == theirs(repetition_penalty=1.4)
    assert penalized != ours()
    assert ours(logit_bias={comma: -8.0}) == theirs(sequence_bias={(comma,): -8.0})
