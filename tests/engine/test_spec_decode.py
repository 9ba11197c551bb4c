"""Speculative decoding through the real engine on tiny random models: a draft model of random weights
changes nothing but speed (greedy and seeded sampling, chunked prefill, prefix hits, preemption, n > 1,
penalties, logprobs), a draft equal to the target is accepted almost always (its paged KV follows the
target's through all of that), every KV block comes back after aborts, and sampled output keeps the
target's distribution (chi-square). The n-gram method on the bundled model: test_spec_decode_smollm2.py."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from services import LLM, SamplingParams
from tests.engine.conftest import make_tiny_model
from tests.engine.eagle3_heads import random_eagle3_head

# Small enough (160 token slots) that 6 prompts of 21-38 tokens and their outputs preempt; 24-token steps chunk them.
ENGINE = dict(dtype="float32", block_size=4, num_kv_blocks=40, max_num_batched_tokens=24, max_num_seqs=8)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("spec") / "target")


@pytest.fixture(scope="module")
def random_draft_dir(tmp_path_factory):
    """Another architecture size, other random weights, the same vocabulary."""
    return make_tiny_model(tmp_path_factory.mktemp("spec") / "draft", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)


def prompts() -> list[list[int]]:
    shared = [(37 * i) % 3000 + 50 for i in range(17)]
    out = []
    for i in range(6):
        motif = [(101 * i + 7 * j) % 4000 + 60 for j in range(5)]
        out.append((shared if i % 2 else []) + motif * 4 + [900 + i])
    return out


def params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=28),
            SamplingParams(temperature=0, max_tokens=20, n=2),
            SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=7, max_tokens=24),
            SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=16, presence_penalty=0.5,
                           frequency_penalty=0.3, repetition_penalty=1.2),
            SamplingParams(temperature=0, max_tokens=24, min_tokens=10, logprobs=2),
            SamplingParams(temperature=1.0, seed=11, max_tokens=24, min_p=0.05, logit_bias={70: 3.0})]


def run(llm: LLM):
    outs = llm.generate(prompts(), params(), use_tqdm=False)
    llm.core.pool.check_invariants()
    assert llm.core.pool.num_free == llm.core.pool.num_blocks and not llm.core.kv.tables  # every block back
    return [[(c.token_ids, [round(lp.logprob, 4) for lp in c.logprobs or []]) for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def plain_outputs(target_dir):
    return run(LLM(model=str(target_dir), **ENGINE))


def test_random_draft_model_changes_only_speed(target_dir, random_draft_dir, plain_outputs):
    spec = {"method": "draft_model", "model": str(random_draft_dir), "num_speculative_tokens": 3}
    llm = LLM(model=str(target_dir), speculative_config=spec, **ENGINE)
    assert llm.core.info.draft_method == "draft_model"
    assert run(llm) == plain_outputs
    assert llm.core.stats().spec_decode.num_draft_tokens > 0
    assert llm.core.scheduler.num_preemptions > 0 and llm.core.kv.prefix_hits > 0


def test_random_eagle3_head_changes_only_speed(target_dir, plain_outputs, tmp_path):
    """A head in the published layout (midlayer.*, fc over three target layers, a draft vocabulary of 1,000
    ids mapped by d2t): its proposals are noise, the output is the target's."""
    # Two target layers: the head reads the stream entering layer 1 three times (the config names them).
    head = random_eagle3_head(target_dir, tmp_path / "eagle3", seed=3, draft_vocab=1000, aux_layers=[1, 1, 1])
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3, "knee_tokens": 1000}
    llm = LLM(model=str(target_dir), speculative_config=spec, **ENGINE)
    assert llm.core.info.draft_method == "eagle3" and llm.runner.model.aux_layers == (1, 1, 1)
    assert run(llm) == plain_outputs
    s = llm.core.stats().spec_decode
    assert s.num_draft_tokens > 50 and llm.core.scheduler.num_preemptions > 0
    assert llm.runner.model.aux_hidden is None  # consumed every step


def test_eagle3_layouts_and_refusals(tmp_path):
    target = make_tiny_model(tmp_path / "t4", num_hidden_layers=4)
    ok = random_eagle3_head(target, tmp_path / "layers0", layer_prefix="layers.0.")
    spec = {"method": "eagle3", "model": str(ok), "num_speculative_tokens": 2}
    llm = LLM(model=str(target), dtype="float32", num_kv_blocks=64, speculative_config=spec)
    assert llm.runner.model.aux_layers == (2, 2, 1)  # vLLM's default for 4 layers: (2, 4 // 2, 4 - 3)
    out = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
    cfg = json.loads((ok / "config.json").read_text())
    for change, field in (({"num_hidden_layers": 2}, "decoder layers"), ({"hidden_size": 32}, "hidden size"),
                          ({"architectures": ["LlamaForCausalLM"]}, "not an EAGLE-3 head"),
                          ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 9]}}, "three layers")):
        bad = tmp_path / f"bad{len(field)}"
        shutil.copytree(ok, bad)
        (bad / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ValueError, match=field):
            LLM(model=str(target), dtype="float32", num_kv_blocks=64,
                speculative_config={**spec, "model": str(bad)})


def test_draft_equal_to_target_is_accepted_through_preemption_and_prefix_hits(target_dir):
    """The draft's own KV cache must hold what the target's does at every committed position (prefix hits,
    copy-on-write forks, preemption, rejected slots given back): then its greedy drafts are the target's
    greedy tokens, and every greedy draft is accepted."""
    spec = {"method": "draft_model", "model": str(target_dir), "num_speculative_tokens": 3, "knee_tokens": 1000}
    greedy = [SamplingParams(temperature=0, max_tokens=28)] * 6
    llm = LLM(model=str(target_dir), **ENGINE)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts(), greedy, use_tqdm=False)]
    llm = LLM(model=str(target_dir), speculative_config=spec, **ENGINE)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts(), greedy, use_tqdm=False)] == want
    s = llm.core.stats().spec_decode
    assert s.num_draft_tokens > 50 and s.acceptance_rate > 0.97, s
    assert llm.core.scheduler.num_preemptions > 0 and llm.core.kv.prefix_hits > 0
    assert llm.core.pool.num_free == llm.core.pool.num_blocks


def test_aborts_mid_speculation_give_every_block_back(target_dir):
    spec = {"method": "draft_model", "model": str(target_dir), "num_speculative_tokens": 3, "knee_tokens": 1000}
    llm = LLM(model=str(target_dir), speculative_config=spec, **ENGINE)
    core = llm.core
    for i, p in enumerate(prompts()):
        core.add_request(f"a{i}", p, SamplingParams(temperature=0, max_tokens=40))
    for _ in range(12):
        core.step()
    assert core.stats().spec_decode.num_drafts > 0
    for i in range(0, 6, 2):
        core.abort_request(f"a{i}")
    while core.has_unfinished():
        core.step()
        core.pool.check_invariants()
    assert core.pool.num_free == core.pool.num_blocks and not core.kv.tables


def _chi2_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile for the normal quantile z (3.09: p = 0.001), by Wilson-Hilferty."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def noisy_copy(model_dir, out, seed: int, scale: float = 0.5):
    """A seeded random draft: the target's weights plus Gaussian noise of `scale` times each tensor's
    spread (so its drafts are sometimes right, sometimes not)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out)
    gen = torch.Generator().manual_seed(seed)
    for f in out.glob("*.safetensors"):
        tensors = load_file(str(f))
        save_file({k: (v + torch.randn(v.shape, generator=gen) * scale * v.float().std()).to(v.dtype)
                   if v.dim() > 1 else v for k, v in tensors.items()}, str(f), metadata={"format": "pt"})
    return out


def test_sampled_tokens_keep_the_target_distribution(tmp_path):
    """Temperature 1, a seeded random draft model (the target's weights plus seeded noise): the tokens at the
    verified positions (the second and third generated: the first comes from the prefill) have the target's
    exact marginal distribution, computed with transformers over every first and second token, whether
    their draft was accepted or not. Chi-square at p = 0.001."""
    from transformers import AutoModelForCausalLM

    vocab = 24
    target = make_tiny_model(tmp_path / "t", vocab_size=vocab)
    draft = noisy_copy(target, tmp_path / "d", seed=99, scale=0.05)
    prompt = [3, 7, 1, 12, 5]
    hf = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    with torch.no_grad():
        p1 = hf(torch.tensor([prompt])).logits[0, -1].softmax(-1)
        ctx = torch.tensor([prompt + [a] for a in range(vocab)])
        p2_given = hf(ctx).logits[:, -1].softmax(-1)  # [t1, t2]
        ctx3 = torch.tensor([prompt + [a, b] for a in range(vocab) for b in range(vocab)])
        p3_given = hf(ctx3).logits[:, -1].softmax(-1).view(vocab, vocab, vocab)
    joint12 = p1[:, None] * p2_given
    expected = {1: joint12.sum(0), 2: (joint12[:, :, None] * p3_given).sum((0, 1))}

    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2, "knee_tokens": 1000}
    # Eight at a time: a step of thousands of prompts is far past the knee, and speculation turns itself off.
    llm = LLM(model=str(target), dtype="float32", num_kv_blocks=512, max_num_seqs=8, speculative_config=spec)
    n = 1500
    outs = llm.generate([prompt] * n, [SamplingParams(temperature=1.0, seed=s, max_tokens=3, ignore_eos=True)
                                       for s in range(n)], use_tqdm=False)
    stats = llm.core.stats().spec_decode
    # Every request verified a draft after its first token; some were accepted, most not.
    assert stats.num_draft_tokens >= n and 0.02 * n < stats.num_accepted_tokens < 0.95 * n, stats
    for pos in (1, 2):
        counts = torch.bincount(torch.tensor([o.outputs[0].token_ids[pos] for o in outs]), minlength=vocab).double()
        exp = expected[pos].double() * n
        keep = exp >= 5  # pool the rare tokens into one cell, as the test requires
        obs = torch.cat([counts[keep], counts[~keep].sum(0, keepdim=True)])
        ex = torch.cat([exp[keep], exp[~keep].sum(0, keepdim=True)])
        if ex[-1] < 5:
            obs, ex = obs[:-1], ex[:-1]
        stat = float(((obs - ex) ** 2 / ex).sum())
        assert stat < _chi2_critical(len(ex) - 1), (pos, stat, len(ex))
