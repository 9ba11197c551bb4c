"""Decode graphs with several KV groups (services/engine/cuda_graphs.py, on the CPU through the fake
capture): a Gemma 2 model's padded decode steps, each group's slots and tables in the captured buffer,
replay to the tokens eager steps give, and to transformers'."""

from __future__ import annotations

from services.engine.config import EngineConfig
from services.engine.cuda_graphs import FakeGraphCapture
from services.engine.model_runner import ModelRunner
from services.model_files.tokenizer import ModelTokenizer
from services.request.sampling_params import SamplingParams
from services.scheduler.core import SchedulerCore
from services.scheduler.executor import InProcessExecutor
from tests.engine.models.test_families import MAX_TOKENS, tiny


def _run(model_dir, prompts, eager: bool):
    capture = FakeGraphCapture()
    runner = ModelRunner(EngineConfig(model=str(model_dir), dtype="float32", block_size=4, num_kv_blocks=200,
                                      max_num_seqs=4, attention_backend="cpu", enforce_eager=eager),
                         graph_capture=capture)
    core = SchedulerCore(InProcessExecutor(runner), ModelTokenizer(model_dir), max_num_seqs=4,
                         max_num_batched_tokens=64)
    for i, p in enumerate(prompts):
        core.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    outs = {}
    while core.has_unfinished():
        for o in core.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
    return [outs[f"r{i}"] for i in range(len(prompts))], capture, runner


def test_graphs_with_kv_groups_match_eager_and_transformers(tmp_path_factory, hf_cache):
    model_dir, prompts, want = tiny("gemma2-softcaps", tmp_path_factory, hf_cache)
    graphs, capture, runner = _run(model_dir, prompts[:4], eager=False)
    assert runner.kv_plan.num_groups == 2 and capture.replays > 0
    eager, _, _ = _run(model_dir, prompts[:4], eager=True)
    assert graphs == eager == want[:4]
