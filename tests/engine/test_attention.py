"""Attention backends: chosen independently of the device, with clear errors where one cannot run; the
whole engine on the Triton backend (Triton's interpreter, float32) gives the reference backend's and
transformers' greedy tokens; and an engine step (mixed decodes, fresh prompts, continuation chunks)
reads nothing back from the device, proven on the CPU with a guard that fails on any host read."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM

from services import LLM, SamplingParams
from services.device_check.step_driver import StepDriver
from services.engine.attention import resolve_backend
from services.engine.config import EngineConfig
from services.engine.model_runner import ModelRunner
from tests.engine.conftest import hf_greedy
from tests.engine.host_reads import HostReadError, guard_forward, no_host_reads


def test_backend_defaults_by_device_and_is_independent_of_it():
    assert resolve_backend("auto", torch.device("cpu")) == "cpu"
    assert resolve_backend(None, torch.device("cuda")) == "triton"
    assert resolve_backend("reference", torch.device("cuda")) == "reference"
    assert resolve_backend("triton", torch.device("cpu")) == "triton"  # TRITON_INTERPRET=1 in tests


def test_backends_that_cannot_run_are_clear_errors(monkeypatch):
    with pytest.raises(ValueError, match="C\\+\\+ CPU kernels"):
        resolve_backend("cpu", torch.device("cuda"))
    with pytest.raises(ValueError, match="one of auto, triton, cpu, reference"):
        resolve_backend("flash", torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_backend("triton", torch.device("cpu"))


def mixed_steps(runner) -> StepDriver:
    """Three steps: prompts and a first chunk; decodes beside a fresh prompt and a continuation; decodes."""
    d = StepDriver(runner)
    d.add("a", list(range(200, 210)))
    d.add("b", list(range(300, 333)))
    d.add("long", list(range(400, 440)))
    d.step({"long": 24})  # a, b whole; long's first chunk (no sample)
    d.add("fresh", list(range(500, 505)))
    d.step()  # decodes a, b; long's continuation over cached blocks; fresh prompt
    d.step()  # decodes only
    return d


@pytest.mark.parametrize("backend", ["triton", "cpu"])
def test_a_step_reads_nothing_back_from_the_device(tiny_model_dir, backend):
    runner = ModelRunner(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=32,
                                      attention_backend=backend))
    guards = guard_forward(runner.model)
    d = mixed_steps(runner)
    assert len(guards) == 3 and all(g.checked > 50 for g in guards), "the guard saw the forwards' torch calls"
    assert all(len(s.samples) >= 1 for s in d.seqs.values())


def test_the_guard_catches_host_reads(tiny_model_dir):
    # The reference backend is the specification and reads its index tensors on the host: caught.
    runner = ModelRunner(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=32,
                                      attention_backend="reference"))
    guard_forward(runner.model)
    with pytest.raises(HostReadError, match="host read of a device tensor"):
        mixed_steps(runner)
    t = torch.ones(3)
    for read in (lambda: t.sum().item(), lambda: bool(t.any()), lambda: t.tolist(), lambda: t.to("cpu"),
                 lambda: int(t[0]), lambda: f"{t[0]}", lambda: t[t > 0], lambda: t.nonzero(),
                 lambda: torch.repeat_interleave(t, t.long())):
        with no_host_reads(), pytest.raises(HostReadError):
            read()
    with no_host_reads():
        (t * 2).to(torch.float16).index_select(0, torch.tensor([0, 2]))  # device-side work is fine


def run_engine(model_dir, backend: str) -> tuple[list[list[list[int]]], dict]:
    """The workload the Triton parity test runs, with counts of what the scheduler made it do."""
    rng = random.Random(12)
    prompts = [[rng.randrange(100, 49152) for _ in range(n)] for n in (12, 23, 30, 60)]
    llm = LLM(model=str(model_dir), dtype="float32", block_size=16, num_kv_blocks=7, max_num_batched_tokens=32,
              attention_backend=backend)
    assert llm.runner.model.attn.name == backend
    seen = Counter()

    def observe(core) -> None:
        out = core.last_output
        lens = [len(s.token_ids) for s in out.sequences]
        seen["mixed"] += any(n == 1 for n in lens) and any(n > 1 for n in lens)
        seen["chunks"] += any(s.start_pos > 0 and len(s.token_ids) > 1 for s in out.sequences)
        seen["copies"] += len(out.blocks_to_copy)

    llm.step_hook = observe
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, n=2 if len(p) == 23 else 1)
              for p in prompts]
    outs = llm.generate(prompts, params, use_tqdm=False)
    seen["preemptions"] = llm.core.scheduler.num_preemptions
    # Then a prompt sharing the 60-token prompt's first 48 tokens: a prefix-cache hit.
    probe = prompts[3][:48] + [rng.randrange(100, 49152) for _ in range(9)]
    hit = llm.generate([probe], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    seen["cached_tokens"] = hit.num_cached_tokens
    tokens = [[c.token_ids for c in o.outputs] for o in [*outs, hit]]
    return tokens, {"prompts": [*prompts, probe], **seen}


def test_engine_on_triton_matches_reference_and_transformers(tiny_model_dir):
    """The whole engine on the Triton kernels (interpreter, float32): mixed decode + prefill batches,
    chunked prefill, preemption, n=2 with copy-on-write, a prefix-cache hit."""
    triton_tokens, seen = run_engine(tiny_model_dir, "triton")
    assert seen["mixed"] and seen["chunks"] and seen["copies"] and seen["preemptions"], seen
    assert seen["cached_tokens"] >= 32, seen
    reference_tokens, _ = run_engine(tiny_model_dir, "reference")
    assert triton_tokens == reference_tokens
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    for prompt, samples in zip(seen["prompts"], triton_tokens, strict=True):
        want = hf_greedy(hf, prompt, 8)
        assert all(s == want for s in samples), f"prompt of {len(prompt)} tokens diverged from transformers"
