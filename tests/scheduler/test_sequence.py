"""The token history penalties read comes from the scheduler's sequences with every step, so it stays
exact when sequences are preempted and recomputed, when a step is re-run by step isolation, and when a
prompt forks into n samples: each checked end to end on a tiny random Llama against a float64 reference
(the Hugging Face model's logits, the rule of tests/engine/test_logits_processors.py, the sampler's
seeded noise), and best_of picks the samples of highest cumulative logprob."""

from __future__ import annotations

import pytest
import torch

from services import LLM, SamplingParams
from services.engine.sampler import _row_seed
from services.scheduler.core import SchedulerCore
from services.scheduler.executor import InProcessExecutor
from services.scheduler.sequence import penalty_template
from tests.engine.conftest import make_tiny_model
from tests.engine.test_logits_processors import reference_penalties

PROMPTS = [list(range(2000, 2020)), list(range(700, 716)) * 2, [5, 9, 5, 9, 11] * 4, list(range(40000, 40030))]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3,
                        frequency_penalty=0.5, presence_penalty=0.4, logit_bias={17: 12.0, 2001: -5.0})
SEEDED = SamplingParams(temperature=0.8, seed=11, max_tokens=12, ignore_eos=True, repetition_penalty=1.2,
                        min_p=0.05)
FORKED = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True, frequency_penalty=1.0,
                        presence_penalty=-0.5)
BIASED = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias={300: 8.0, 301: 7.5})
PARAMS = [GREEDY, SEEDED, FORKED, BIASED]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("penalties") / "llama")


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def reference(hf, prompt: list[int], params: SamplingParams, sample_index: int = 0) -> list[int]:
    """Token by token from full forwards: the rule in float64, then greedy or the sampler's seeded draw."""
    out: list[int] = []
    template = penalty_template(params, prompt)
    for _ in range(params.max_tokens):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0, -1].double()
        if template is not None:
            template.output_token_ids = out
            logits = reference_penalties(logits, template)
        if params.temperature == 0:
            out.append(int(logits.argmax()))
            continue
        p = torch.softmax(logits / params.temperature, -1)
        if params.min_p:
            p = torch.where(p >= params.min_p * p.max(), p, torch.zeros_like(p))
        g = torch.Generator().manual_seed(_row_seed(params.seed, sample_index, len(out)))
        noise = torch.empty(p.shape[0], dtype=torch.float32).exponential_(generator=g)
        out.append(int((p / noise.double()).argmax()))
    return out


_REFERENCE: dict[tuple[int, int], list[int]] = {}  # (request, sample) -> tokens: both tests check the same


def _check(outputs, hf) -> None:
    for i, (prompt, params, got) in enumerate(zip(PROMPTS, PARAMS, outputs, strict=True)):
        for j, choice in enumerate(got.outputs):
            if (i, j) not in _REFERENCE:
                _REFERENCE[i, j] = reference(hf, prompt, params, j)
            assert choice.token_ids == _REFERENCE[i, j], (params, j)


def test_penalties_stay_exact_under_preemption_and_forks(model_dir, hf):
    # 8 blocks of 16 tokens cannot hold six sequences of 32 to 42: the scheduler preempts and recomputes.
    llm = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=8, max_num_batched_tokens=32)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert llm.core.scheduler.num_preemptions > 0
    assert llm.core.pool.num_in_use == 0
    _check(outs, hf)
    # The bias puts token 17 first; the penalties then push it back down as it repeats.
    got = outs[0].outputs[0].token_ids
    assert got[0] == 17 and 1 < got.count(17) < len(got)


class FailingOnce(InProcessExecutor):
    """Fails every step holding the poisoned request, so step isolation re-runs the rest without it."""

    def execute(self, out):
        if any(s.seq_id.startswith("poison") for s in out.sequences):
            raise RuntimeError("sampler blew up")
        return super().execute(out)


def test_penalties_stay_exact_when_step_isolation_reruns_a_step(model_dir, hf):
    llm = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=64)
    core = SchedulerCore(FailingOnce(llm.runner), llm.tokenizer, max_num_batched_tokens=64)
    for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS, strict=True)):
        core.add_request(f"r{i}", prompt, params)
    core.add_request("poison", [3, 4, 5], GREEDY)
    done = {}
    while core.has_unfinished():
        for out in core.step():
            if out.finished:
                done[out.request_id] = out
    assert done["poison"].error_kind == "request"
    _check([done[f"r{i}"] for i in range(len(PROMPTS))], hf)
    assert core.pool.num_in_use == 0


def test_best_of_returns_the_n_samples_of_highest_cumulative_logprob(model_dir):
    llm = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=64)
    every = llm.generate([PROMPTS[0]], SamplingParams(n=5, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True,
                                                      logprobs=0), use_tqdm=False)[0].outputs
    sums = [sum(lp.logprob for lp in c.logprobs) for c in every]
    assert [c.cumulative_logprob for c in every] == pytest.approx(sums)
    best = llm.generate([PROMPTS[0]], SamplingParams(n=2, best_of=5, temperature=1.0, seed=3, max_tokens=6,
                                                     ignore_eos=True), use_tqdm=False)[0].outputs
    ranked = sorted(every, key=lambda c: -c.cumulative_logprob)[:2]
    assert [c.index for c in best] == [0, 1]
    assert [c.token_ids for c in best] == [c.token_ids for c in ranked]
    assert best[0].logprobs is None  # computed for the ranking, not returned unasked
    assert llm.core.pool.num_in_use == 0
