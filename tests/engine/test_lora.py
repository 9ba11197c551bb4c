"""LoRA adapters in the engine and scheduler, against PEFT + transformers on a tiny random Llama.

A mixed greedy batch of base-model requests and requests for two seeded random rank-8 adapters (every
projection, saved by PEFT's save_pretrained) runs together with chunked prefill, prefix hits and
preemption; each must match PEFT's own `generate` for its adapter. The cache is keyed by adapter
content: the same prompt under another adapter is never a hit, under the same one it is, and an
adapter whose files were overwritten and reloaded never serves the old blocks."""

from __future__ import annotations

import shutil

import pytest

from services import LLM, SamplingParams
from tests.engine.lora_adapters import peft_greedy, peft_model, save_random_adapter

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {"A": save_random_adapter(tiny_model_dir, root / "A", seed=1),
            "B": save_random_adapter(tiny_model_dir, root / "B", seed=2, alpha=32, use_rslora=True)}


@pytest.fixture(scope="module")
def reference(tiny_model_dir, adapters):
    return peft_model(tiny_model_dir, adapters)


def _prompts(n: int) -> list[list[int]]:
    shared = [(37 * i + 11) % 4000 + 100 for i in range(40)]  # 2.5 blocks shared by every prompt
    return [shared + [(13 * i + 7 * k) % 3000 + 200 for k in range(5 + 9 * i)] for i in range(n)]


def test_mixed_batch_matches_peft(tiny_model_dir, adapters, reference):
    # Two adapters and the base model, a 48-token budget (chunked prefill) and a KV pool too small
    # for the whole batch (preemption); prefixes are shared within each adapter.
    llm = LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=40, max_num_batched_tokens=48,
              max_loras=2, max_lora_rank=16)
    for name, path in adapters.items():
        llm.load_lora(name, str(path))
    prompts = _prompts(9)
    names = [None, "A", "B"] * 3
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=names)
    assert llm.core.scheduler.num_preemptions > 0
    assert llm.core.kv.prefix_hits > 0
    seen = {}
    for p, name, o in zip(prompts, names, outs, strict=True):
        want = peft_greedy(reference, name, p, GREEDY.max_tokens)
        assert o.outputs[0].token_ids == want, f"adapter {name} diverged on a prompt of {len(p)} tokens"
        seen.setdefault(name, []).append(tuple(want))
    assert len({seen[None][0], seen["A"][0], seen["B"][0]}) == 3, "the adapters must change the output"


def test_cache_is_keyed_by_adapter_content(tiny_model_dir, adapters, reference, tmp_path):
    llm = LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64, max_loras=2, max_lora_rank=8)
    moving = tmp_path / "moving"
    shutil.copytree(adapters["A"], moving)
    llm.load_lora("A", str(moving))
    llm.load_lora("B", str(adapters["B"]))
    prompt = _prompts(3)[2]

    def cached(name):
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False,
                           lora_request=name)[0]
        return out.num_cached_tokens, out.outputs[0].token_ids

    assert cached("A")[0] == 0
    assert cached("B")[0] == 0, "another adapter must not hit A's blocks"
    hit, tokens_a = cached("A")
    assert hit > 0, "the same adapter must hit its own blocks"
    assert cached(None)[0] == 0, "the base model must not hit an adapter's blocks"
    # Overwrite A's files with B's and reload under the same name: a new digest, no stale hit, B's answers.
    for f in adapters["B"].iterdir():
        shutil.copy(f, moving / f.name)
    llm.load_lora("A", str(moving))
    hit, tokens = cached("A")
    assert hit > 0 and tokens == cached("B")[1], "same content as B: B's blocks, B's answers"
    assert tokens != tokens_a


def test_unload_waits_for_requests_in_flight(tiny_model_dir, adapters):
    llm = LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64, max_loras=1, max_lora_rank=8)
    llm.load_lora("A", str(adapters["A"]))
    ref = llm.core.loras.get("A")
    for i, p in enumerate(_prompts(4)):
        llm.core.add_request(f"r{i}", p, GREEDY, lora_name="A")
    llm.core.step()
    llm.unload_lora("A")
    assert llm.runner.lora.knows(ref.digest), "requests in flight still use it"
    done = []
    while llm.core.has_unfinished():
        done += [o for o in llm.core.step() if o.finished]
    assert len(done) == 4 and all(o.error is None and len(o.outputs[0].token_ids) == 12 for o in done)
    assert not llm.runner.lora.knows(ref.digest)


def test_bad_lora_fields_are_refused_naming_the_sequence(tiny_model_dir, adapters):
    from services.contracts.step_protocol import InvalidStepError, SamplingSpec, ScheduledSequence, SchedulerOutput

    llm = LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=16, max_loras=1, max_lora_rank=8)
    digest = llm.load_lora("A", str(adapters["A"])).digest

    def step(slot, pairs):
        seq = ScheduledSequence("s1", [5, 6, 7], 0, [0], True, SamplingSpec(), lora_slot=slot)
        return SchedulerOutput(1, [seq], lora_slots=pairs)

    for slot, pairs, field in ((3, [], "lora_slot"), (0, [], "lora_slot"), ("0", [(0, digest)], "lora_slot"),
                               (0, [(0, "f" * 64)], "lora_slot"), (-1, [(9, digest)], "lora_slots")):
        with pytest.raises(InvalidStepError) as e:
            llm.runner.execute(step(slot, pairs))
        assert e.value.faults[0].field == field, (slot, pairs, e.value)
    assert llm.runner.execute(step(0, [(0, digest)])).sampled["s1"]


@pytest.fixture(scope="module")
def smollm2_adapters(tmp_path_factory):
    """Two rank-8 adapters on every projection of the bundled SmolLM2, and PEFT's greedy tokens for each
    (prompt, adapter), computed once for every tensor-parallel size."""
    from services.model_files.model_source import resolve_model

    model_dir = resolve_model(None)
    root = tmp_path_factory.mktemp("smollm2-adapters")
    adapters = {"A": save_random_adapter(model_dir, root / "A", seed=11),
                "B": save_random_adapter(model_dir, root / "B", seed=12)}
    reference, expected = [], {}

    def want(name, prompt):
        if not reference:
            reference.append(peft_model(model_dir, adapters))
        key = (name, tuple(prompt))
        if key not in expected:
            expected[key] = peft_greedy(reference[0], name, prompt, 16)
        return expected[key]

    return adapters, want


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 3])
def test_smollm2_mixed_batch_matches_peft(smollm2_adapters, tp):
    """The bundled SmolLM2-135M (float32) with two rank-8 adapters on every projection: base, A and B requests
    batched together with chunked prefill, a shared prefix and preemption match PEFT + transformers, on one
    rank and on three (3 query heads and 1 KV head each, adapters sliced the same way)."""
    adapters, want = smollm2_adapters
    llm = LLM(dtype="float32", num_kv_blocks=14, max_num_batched_tokens=64, max_loras=2, max_lora_rank=8,
              tensor_parallel_size=tp)
    for name, path in adapters.items():
        llm.load_lora(name, str(path))
    tok = llm.tokenizer
    shared = tok.encode("A paged KV cache stores keys and values in fixed-size blocks, shared between requests, "
                        "freed at once when a request ends, and found again by the hash of their tokens. ")
    prompts = [shared + tok.encode(q) for q in ("Why blocks?", "Who frees them?", "What is a prefix hit?")] * 3
    names = [None] * 3 + ["A"] * 3 + ["B"] * 3
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False,
                        lora_request=names)
    stats = (llm.core.scheduler.num_preemptions, llm.core.kv.prefix_hits)
    llm.close()
    assert stats[0] > 0 and stats[1] > 0, f"preemptions, prefix-hit tokens: {stats}"
    for p, name, o in zip(prompts, names, outs, strict=True):
        assert o.outputs[0].token_ids == want(name, p), f"adapter {name} diverged"
    assert outs[0].outputs[0].token_ids != outs[3].outputs[0].token_ids != outs[6].outputs[0].token_ids
