"""Guided decoding in the engine: the sampler honours each row's token mask on every path (greedy, random
with top-k/top-p, logprobs, n > 1 forks), and the offline LLM on a tiny random model, whose unconstrained
output is noise, returns output that parses and validates with finish_reason "stop"."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from kernels.token_bitmask import unpack_bitmask_ref
from services import LLM, SamplingParams
from services.contracts.step_protocol import SamplingSpec
from services.engine.sampler import Sampler, SampleRow
from services.request.structured_outputs import StructuredOutputsParams


def pack(allowed: list[int], vocab: int) -> bytes:
    words = [0] * ((vocab + 31) // 32)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return b"".join((w if w < 2**31 else w - 2**32).to_bytes(4, "little", signed=True) for w in words)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampler_picks_only_allowed_tokens_on_every_path(dtype):
    import kernels.cpu

    ext = kernels.cpu.load()
    vocab, gen = 3000, torch.Generator().manual_seed(7)
    hidden = torch.randn(8, 64, generator=gen).to(dtype)
    weight = torch.randn(vocab, 64, generator=gen).to(dtype)
    logits = (hidden.float() @ weight.float().T).to(dtype)
    allowed = [5, 77, 1500, 2999]
    mask = pack(allowed, vocab)
    fast = ext if dtype != torch.float32 else None
    sampler = Sampler(torch.device("cpu"), fast and fast.argmax_rows, fast and fast.argmax_rows_exact)
    greedy = SampleRow(SamplingSpec(temperature=0.0), 0, 0, bitmask=mask)
    hot = SampleRow(SamplingSpec(temperature=5.0, top_k=3, top_p=0.9), 0, 0, bitmask=mask)
    lp = SampleRow(SamplingSpec(temperature=0.0, logprobs=3), 0, 0, bitmask=mask)
    free = SampleRow(SamplingSpec(temperature=0.0), 0, 0)
    exact = hidden.float() @ weight.float().T
    best_allowed = [max(allowed, key=lambda t, i=i: exact[i, t].item()) for i in range(8)]
    for rows in ([greedy] * 8, [greedy, hot] * 4, [lp, free] * 4, [hot] * 8):
        tokens, lps = sampler(logits.clone(), rows, hidden, weight)
        for i, (r, t, p) in enumerate(zip(rows, tokens, lps, strict=True)):
            if r.bitmask is not None:
                assert t in allowed
            if r is greedy:
                assert t == best_allowed[i]
            if r is lp:
                assert set(p.top_ids) <= set(allowed) and p.logprob > -20
    assert tokens  # the free row is untouched
    free_tokens, _ = sampler(logits.clone(), [free] * 8, hidden, weight)
    masked_free, _ = sampler(logits.clone(), [free, greedy] * 4, hidden, weight)
    assert masked_free[0::2] == free_tokens[0::2], "a constrained neighbour does not change a free row"
    assert unpack_bitmask_ref(torch.frombuffer(bytearray(mask), dtype=torch.int32).view(1, -1),
                              vocab)[0].nonzero().flatten().tolist() == allowed


SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
                         "pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}},
                                 "required": ["kind"]}},
          "required": ["name", "age", "tags", "pet"]}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_offline_llm_output_parses_for_every_constraint(tiny_model_dir, dtype):
    llm = LLM(model=str(tiny_model_dir), dtype=dtype, num_kv_blocks=256)
    so = [StructuredOutputsParams(json=SCHEMA, strict=True), StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,4}"),
          StructuredOutputsParams(choice=["red", "green", "blue"]),
          StructuredOutputsParams(grammar='start: "call " NAME "(" %json {"type": "object", "properties": '
                                          '{"x": {"type": "integer"}}, "required": ["x"], '
                                          '"additionalProperties": false} ")"\nNAME: /[a-z]{1,8}/')]
    params = [SamplingParams(temperature=t, max_tokens=100, n=n, seed=1, structured_outputs=s)
              for s in so for t, n in ((0.0, 1), (1.0, 3))]
    outs = llm.generate(["Describe a person:", "hi"] * 4, params, use_tqdm=False)
    for p, out in zip(params, outs, strict=True):
        for c in out.outputs:
            assert c.finish_reason == "stop", (p.structured_outputs.kind, c.text)
            kind = p.structured_outputs.kind
            if kind == "json":
                jsonschema.validate(json.loads(c.text), SCHEMA)
            elif kind == "regex":
                assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", c.text)
            elif kind == "choice":
                assert c.text in ("red", "green", "blue")
            else:
                m = re.fullmatch(r"call [a-z]{1,8}\((.*)\)", c.text, re.S)
                assert m and isinstance(json.loads(m.group(1))["x"], int)
    assert llm.core.pool.num_free == llm.core.pool.num_blocks
