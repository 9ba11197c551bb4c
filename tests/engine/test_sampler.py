"""Sampling on a tiny random model: seeds, top-k/top-p, n > 1, log-probabilities, bad input."""

from __future__ import annotations

import pytest
import torch

from services import LLM, InvalidRequestError, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=256)


PROMPT = list(range(2000, 2030))


def _gen(llm, params, prompts=None):
    return llm.generate(prompts or [PROMPT], params, use_tqdm=False)


def test_seed_is_reproducible_whatever_the_batch(llm):
    p = SamplingParams(temperature=1.0, max_tokens=12, seed=42, ignore_eos=True)
    alone = _gen(llm, p)[0].outputs[0].token_ids
    crowd = _gen(llm, [SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True)] * 3 + [p],
                 [list(range(50, 80)), list(range(90, 95)), list(range(3000, 3100)), PROMPT])
    assert crowd[3].outputs[0].token_ids == alone
    other = _gen(llm, SamplingParams(temperature=1.0, max_tokens=12, seed=43, ignore_eos=True))
    assert other[0].outputs[0].token_ids != alone


def test_top_k_1_and_tiny_top_p_equal_greedy(llm):
    greedy = _gen(llm, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].outputs[0].token_ids
    k1 = _gen(llm, SamplingParams(temperature=1.5, top_k=1, max_tokens=10, ignore_eos=True))[0].outputs[0].token_ids
    p0 = _gen(llm, SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=10, ignore_eos=True))[0]
    assert k1 == greedy and p0.outputs[0].token_ids == greedy


def test_top_k_restricts_the_support():
    from services.contracts.step_protocol import SamplingSpec
    from services.engine.sampler import Sampler, SampleRow

    logits = torch.randn(1, 100)
    allowed = set(logits[0].topk(5).indices.tolist())
    sampler = Sampler(torch.device("cpu"))
    rows = [SampleRow(SamplingSpec(temperature=2.0, top_k=5), 0, 0)] * 200
    tokens, _ = sampler(logits.expand(200, 100).contiguous(), rows)
    assert set(tokens) <= allowed and len(set(tokens)) > 1
    rows = [SampleRow(SamplingSpec(temperature=1.0, top_p=0.5), 0, 0)] * 200
    probs = logits[0].softmax(-1)
    order = probs.argsort(descending=True).tolist()
    mass, nucleus = 0.0, set()
    for t in order:
        nucleus.add(t)
        mass += probs[t].item()
        if mass >= 0.5:
            break
    tokens, _ = sampler(logits.expand(200, 100).contiguous(), rows)
    assert set(tokens) <= nucleus


def test_n_samples_share_the_prompt(llm):
    out = _gen(llm, SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=7, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    again = _gen(llm, SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=7, ignore_eos=True))[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    assert llm.core.pool.num_in_use == 0


def test_logprobs_match_the_distribution(llm, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    out = _gen(llm, SamplingParams(temperature=0, max_tokens=1, logprobs=3))[0].outputs[0]
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([PROMPT])).logits[0, -1], -1)
    lp = out.logprobs[0]
    top = ref.topk(3)
    assert lp.top_ids == top.indices.tolist()
    assert lp.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-4)
    assert lp.logprob == pytest.approx(ref[out.token_ids[0]].item(), abs=1e-4)


def test_bad_input_names_the_field_and_spares_in_flight_requests(llm):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = _gen(llm, params)[0].outputs[0].token_ids
    llm.core.add_request("inflight", PROMPT, params)
    llm.core.step()
    cases = [([""], params, "prompt"), ([[]], params, "prompt"), ([[5] * 5000], params, "prompt"),
             ([[1, 2, 49152]], params, "prompt"), ([[1, -1]], params, "prompt")]
    for prompts, p, field in cases:
        with pytest.raises(InvalidRequestError) as e:
            llm.generate(prompts, p, use_tqdm=False)
        assert e.value.field == field
    for bad in ({"max_tokens": 0}, {"top_p": 1.01}, {"temperature": -1.0}, {"top_p": 0}):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(**bad)
        assert e.value.field in bad
    done = None
    while done is None:
        for o in llm.core.step():
            if o.request_id == "inflight" and o.finished:
                done = o
    assert done.outputs[0].token_ids == expected


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_banned_tokens_are_never_sampled(temperature, dtype):
    from services.contracts.step_protocol import SamplingSpec
    from services.engine.sampler import Sampler, SampleRow

    torch.manual_seed(0)
    logits = torch.randn(4, 300).to(dtype)
    top = logits.float().topk(5, dim=-1).indices
    rows = [SampleRow(SamplingSpec(temperature, 1.0, -1, 7, None), i, 0, banned=top[i, :3].tolist()) for i in range(3)]
    rows.append(SampleRow(SamplingSpec(temperature, 1.0, -1, 7, None), 3, 0))  # a bystander row: no ban
    for _ in range(20):
        tokens, _ = Sampler(torch.device("cpu"))(logits.clone(), rows)
        for i in range(3):
            assert tokens[i] not in top[i, :3].tolist()
        if temperature == 0.0:
            assert tokens[:3] == top[:3, 3].tolist() and tokens[3] == top[3, 0].item()


@pytest.mark.parametrize("extreme", [{"temperature": 1e-320}, {"temperature": 1e-6}, {"top_p": 1e-50},
                                     {"top_k": 49152, "temperature": 1e300}, {"seed": -(2**63)}])
def test_extreme_valid_values_sample_sensibly(llm, extreme):
    greedy = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    params = SamplingParams(**{"temperature": 1.0, "max_tokens": 4, "ignore_eos": True, **extreme})
    out = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4 and all(0 <= t < 49152 for t in out.token_ids)
    if extreme.get("temperature", 1.0) < 1e-5 or "top_p" in extreme:
        assert out.token_ids == greedy  # too cold to divide by, or only the top token kept: greedy
