"""n-gram speculation on the bundled SmolLM2 in float32: token-identical output with and without it, in
one batch with chunked prefill, prefix-cache hits, preemption, a structured-output request and a LoRA
adapter, on copy-heavy prompts (where drafts are accepted)."""

from __future__ import annotations

import pytest

from services import LLM, SamplingParams
from services.model_files.model_source import resolve_model
from services.request.structured_outputs import StructuredOutputsParams
from tests.engine.lora_adapters import save_random_adapter
from tests.engine.models.test_families import ForcedPreemption

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
# 28 blocks of 16 tokens for six ~70-token prompts and their outputs; 48-token steps: chunks. The pool
# alone does not preempt here (admission waits for blocks), so a step hook preempts every few steps.
ENGINE = dict(dtype="float32", num_kv_blocks=28, max_num_batched_tokens=48, max_num_seqs=6, max_loras=1,
              max_lora_rank=8)
HEADER = "You are a careful assistant. Copy exactly what you are asked to copy.\n"
PROMPTS = [
    HEADER + "Record: id=4411; name=Ada Lovelace; born=1815; field=mathematics.\nRepeat the record: id=4411;",
    HEADER + "def area(w, h):\n    return w * h\n\nRewrite area with width and height:\ndef area(width, height):\n",
    HEADER + "Text: The river rose at dawn and the town rose with it.\nExtract the subject: The river",
    'Reply in JSON like {"city": "Paris", "country": "France"}. The city is Rome, in Italy. JSON:',
    HEADER + "List: apples, pears, plums, cherries.\nThe list again: apples, pears,",
    HEADER + "Say: the quick brown fox jumps over the lazy dog. Again: the quick brown fox",
]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
          "required": ["city", "country"]}


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    return save_random_adapter(resolve_model(None), tmp_path_factory.mktemp("lora") / "a", seed=5, rank=8,
                               std=0.05)


def generate(adapter, spec):
    llm = LLM(speculative_config=spec, **ENGINE)
    llm.step_hook = ForcedPreemption(every=6)  # mid-draft too: rejected drafts and preemption together
    llm.load_lora("a", str(adapter))
    params = [SamplingParams(temperature=0, max_tokens=32) for _ in PROMPTS]
    params[3] = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    params[5] = SamplingParams(temperature=0.7, seed=21, max_tokens=32, logprobs=1)
    outs = llm.generate(PROMPTS, params, use_tqdm=False, lora_request=[None, "a", None, None, None, None])
    core = llm.core
    assert core.pool.num_free == core.pool.num_blocks and not core.kv.tables
    result = [(o.outputs[0].token_ids, [round(lp.logprob, 3) for lp in o.outputs[0].logprobs or []]) for o in outs]
    return result, core


def test_ngram_is_token_identical_in_a_mixed_batch(adapter):
    want, plain = generate(adapter, None)
    got, core = generate(adapter, NGRAM)
    assert got == want
    s = core.stats().spec_decode
    assert s.num_accepted_tokens >= 20, s
    assert core.scheduler.num_preemptions > 0 and core.kv.prefix_hits > 0
    drafted = core.stats().guided.constrained_rows
    assert drafted > 0
