"""Decode CUDA graphs, on the CPU through the same code path with a fake capture: batch sizes and the
bucket a step pads to, what padding rows hold, which steps replay a graph and which run eagerly, and
outputs and KV cache equal to eager execution (Triton backend under the interpreter, float32)."""

from __future__ import annotations

import pytest
import torch

from services.device_check.step_driver import StepDriver
from services.engine import cuda_graphs
from services.engine.config import EngineConfig
from services.engine.cuda_graphs import FakeGraphCapture, capture_sizes
from services.engine.model_runner import ModelRunner
from services.engine.step_inputs import StepInputs


def test_capture_sizes_double_up_to_max_num_seqs():
    assert capture_sizes(1) == [1]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    with pytest.raises(ValueError):
        capture_sizes(0)


def make_runner(model_dir, *, eager: bool, max_num_seqs: int = 8, backend: str = "triton"):
    capture = FakeGraphCapture()
    runner = ModelRunner(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=48,
                                      max_num_seqs=max_num_seqs, attention_backend=backend, enforce_eager=eager),
                         graph_capture=capture)
    return runner, capture


def record_steps(runner) -> list[StepInputs]:
    """Keep every StepInputs the runner builds (what it padded to, what it sampled)."""
    built = []
    build = runner.inputs.build

    def spy(*args, **kwargs):
        step = build(*args, **kwargs)
        built.append(step)
        return step

    runner.inputs.build = spy
    return built


PROMPTS = {"a": list(range(100, 113)), "b": list(range(200, 231)), "c": list(range(300, 302))}


def drive(runner, decode_steps: int = 5) -> StepDriver:
    d = StepDriver(runner)
    for seq_id, prompt in PROMPTS.items():
        d.add(seq_id, prompt)
    for _ in range(decode_steps + 1):
        d.step()
    return d


def test_decode_steps_replay_padded_graphs_and_match_eager(tiny_model_dir):
    runner, capture = make_runner(tiny_model_dir, eager=False)
    assert runner.graphs.sizes == [1, 2, 4, 8] and capture.captured == 4, "one capture per batch size"
    steps = record_steps(runner)
    graph_run = drive(runner)
    eager, eager_capture = make_runner(tiny_model_dir, eager=True)
    assert eager.graphs is None and eager_capture.captured == 0
    eager_run = drive(eager)

    assert [s.graph_batch for s in steps] == [None] + [4] * 5, "prefill eager; 3 decodes pad to the 4-graph"
    assert capture.replays == 5
    for seq_id in PROMPTS:
        assert graph_run.seqs[seq_id].samples == eager_run.seqs[seq_id].samples
    # Padding wrote nothing: the KV cache equals the eager run's (block 0, which padding rows read,
    # belongs to sequence "a" here), and every block no sequence owns is still zero.
    assert torch.allclose(runner.arena, eager.arena, rtol=1e-5, atol=1e-5)
    assert graph_run.seqs["a"].table[0] == 0
    assert not runner.arena[:, :, graph_run.next_block:].any()


def test_padding_rows_write_nowhere_and_are_never_sampled(tiny_model_dir):
    runner, _ = make_runner(tiny_model_dir, eager=False)
    steps = record_steps(runner)
    drive(runner, decode_steps=1)
    step = steps[-1]
    assert step.graph_batch == 4 and step.num_real_decodes == 3
    t = step.layout.tensors(step.host)
    assert t.slot_mapping[0, 3:].tolist() == [-1]
    assert t.decode_context_lens[3:].tolist() == [1]
    assert not t.decode_block_tables[0, 3:].any() and t.input_ids[3:].tolist() == [0]
    width = -(-min(cuda_graphs.GRAPH_MAX_CONTEXT, runner.max_model_len) // 16)
    assert t.decode_block_tables.shape[2] == runner.graphs.width == width
    assert sorted(step.owners) == ["a", "b", "c"] and len(step.rows) == 3


def test_steps_graphs_cannot_take_run_eagerly(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(cuda_graphs, "GRAPH_MAX_CONTEXT", 32)  # graphs hold contexts up to 32 tokens
    runner, capture = make_runner(tiny_model_dir, eager=False, max_num_seqs=2)
    assert runner.graphs.sizes == [1, 2] and runner.graphs.width == 2
    steps = record_steps(runner)
    d = StepDriver(runner)
    d.add("a", list(range(100, 120)))
    d.add("b", list(range(200, 210)))
    d.step()
    d.step()  # two decodes: graph of 2
    d.add("c", list(range(300, 305)))
    d.step()  # a prefill among decodes: eager
    d.step()  # three decodes, more than the largest graph: eager
    del d.seqs["c"]
    for _ in range(11):
        d.step()  # "a" passes 32 tokens of context within these: eager from then on
    batches = [s.graph_batch for s in steps]
    assert batches[:4] == [None, 2, None, None]
    assert 2 in batches[4:] and batches[-1] is None, batches
    assert capture.replays == batches.count(2)


def test_cpu_backend_graph_path_matches_eager(tiny_model_dir):
    # The fake capture drives any backend; the C++ CPU kernels skip padding slots (-1) too.
    runner, capture = make_runner(tiny_model_dir, eager=False, backend="cpu")
    eager, _ = make_runner(tiny_model_dir, eager=True, backend="cpu")
    a, b = drive(runner), drive(eager)
    assert capture.replays == 5
    assert all(a.seqs[s].samples == b.seqs[s].samples for s in PROMPTS)
    assert torch.allclose(runner.arena, eager.arena, rtol=1e-5, atol=1e-5)


def test_adapter_decodes_replay_the_graphs_and_match_eager(tiny_model_dir, tmp_path):
    """With LoRA slots every graph holds the adapters' shrink and expand: a step of base and adapter decodes
    (two adapters, two slots) replays a graph, with the same tokens and KV cache as eager execution."""
    from services.contracts.step_protocol import SchedulerOutput
    from tests.engine.lora_adapters import save_random_adapter

    paths = [save_random_adapter(tiny_model_dir, tmp_path / f"lora{i}", seed=i) for i in range(2)]

    def run(eager: bool):
        capture = FakeGraphCapture()
        runner = ModelRunner(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=48,
                                          max_num_seqs=8, attention_backend="triton", enforce_eager=eager,
                                          max_loras=2, max_lora_rank=8), graph_capture=capture)
        digests = [runner.load_lora(str(p))["digest"] for p in paths]
        adapters = {"a": (0, digests[0]), "b": (1, digests[1])}  # "c" runs on the base model
        steps = record_steps(runner)
        d = StepDriver(runner)
        inner = d.execute

        def execute(out: SchedulerOutput):
            for s in out.sequences:
                s.lora_slot = adapters.get(s.seq_id, (-1, ""))[0]
            out.lora_slots = sorted({adapters[s.seq_id] for s in out.sequences if s.seq_id in adapters})
            return inner(out)

        d.execute = execute
        for seq_id, prompt in PROMPTS.items():
            d.add(seq_id, prompt)
        for _ in range(6):
            d.step()
        return runner, capture, steps, d

    graph, capture, steps, graph_run = run(eager=False)
    eager, _, _, eager_run = run(eager=True)
    assert [s.graph_batch for s in steps] == [None] + [4] * 5 and capture.replays == 5
    assert all(graph_run.seqs[s].samples == eager_run.seqs[s].samples for s in PROMPTS)
    assert torch.allclose(graph.arena, eager.arena, rtol=1e-5, atol=1e-5)
    # The adapters matter: without them "a" decodes other tokens.
    base, _ = make_runner(tiny_model_dir, eager=True)
    assert drive(base).seqs["a"].samples != graph_run.seqs["a"].samples


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_verify_steps_replay_the_decode_graphs(tiny_model_dir, backend):
    """A step of decodes and speculative verify rows is a decode step of one row per token: it replays a
    graph, commits the same tokens as the eager step (the agreeing drafts plus the target's own token), and
    a speculative config sizes the graphs for max_num_seqs * (1 + k) rows."""
    from services.contracts.speculative_config import SpeculativeConfig
    from services.contracts.step_protocol import SchedulerOutput
    from services.device_check.step_driver import scheduled

    spec = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}')
    assert cuda_graphs.graph_rows(4, spec) == 16 and cuda_graphs.graph_rows(4, None) == 4
    assert cuda_graphs.graph_rows(256, spec) == 512  # GRAPH_MAX_VERIFY_ROWS

    # Plain greedy decoding, for the tokens the drafts should (or should not) match.
    reference, _ = make_runner(tiny_model_dir, eager=True, backend=backend)
    ref = drive(reference, decode_steps=4)
    truth = {s: ref.seqs[s].samples for s in PROMPTS}

    def verify_step(runner):
        d = StepDriver(runner)
        for seq_id, prompt in PROMPTS.items():
            d.add(seq_id, prompt)
        d.step()  # the prompts
        wrong = (truth["a"][3] + 1) % 50
        drafts = {"a": [truth["a"][1], truth["a"][2], wrong], "c": [truth["c"][1]], "b": []}
        seqs = []
        for seq_id, s in d.seqs.items():
            tokens = [s.tokens[-1], *drafts[seq_id]]
            d._grow(s, s.computed + len(tokens))
            seq = scheduled(seq_id, tokens, s.computed, s.table)
            seq.num_draft_tokens = len(drafts[seq_id])
            seq.output_index = 1
            seqs.append(seq)
        return runner.execute(SchedulerOutput(2, seqs)).sampled

    graph, capture = make_runner(tiny_model_dir, eager=False, backend=backend)
    steps = record_steps(graph)
    eager, _ = make_runner(tiny_model_dir, eager=True, backend=backend)
    got, want = verify_step(graph), verify_step(eager)
    assert steps[-1].graph_batch == 8 and steps[-1].num_real_decodes == 4 + 1 + 2
    assert capture.replays == 1
    assert got == want
    assert got == {"a": truth["a"][1:4], "b": truth["b"][1:2], "c": truth["c"][1:3]}
