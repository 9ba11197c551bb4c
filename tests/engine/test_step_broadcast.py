"""Rank 0's step broadcast over real gloo (ranks as threads of this process): what another rank
rebuilds is rank 0's validated layout byte for byte (decodes, chunked prefills, copy-on-write, a
graph-padded decode step, a step too big to go inline), heartbeats and resets arrive in order, and
decode steps replayed from (fake) graphs on every rank give the tokens of eager execution and of one
rank; ranks started with different engine flags refuse to start, naming what differs."""

from __future__ import annotations

import dataclasses
import tempfile
import threading

import pytest
import torch

from services.contracts.step_protocol import SchedulerOutput
from services.device_check.step_driver import StepDriver, scheduled
from services.engine.config import EngineConfig
from services.engine.cuda_graphs import FakeGraphCapture
from services.engine.model_runner import ModelRunner
from services.engine.parallel_state import RankGroup, RankGroupError, RankPlace
from services.engine.step_broadcast import INLINE_BYTES, Op, StepReceiver, StepSender
from services.engine.step_inputs import StepInputBuilder
from services.engine.step_validation import StepLimits
from services.engine.tp_worker import serve_steps

CPU = torch.device("cpu")


def groups(size: int, timeout: float = 20.0) -> list[RankGroup]:
    """`size` ranks of one group, each connected from its own thread (connect waits for all)."""
    url = f"file://{tempfile.mkdtemp()}/rendezvous"
    out = [RankGroup(RankPlace(r, size, r, size, url), CPU, timeout) for r in range(size)]
    threads = [threading.Thread(target=g.connect) for g in out]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def steps() -> list[SchedulerOutput]:
    table = list(range(10, 60))
    return [
        SchedulerOutput(1, [scheduled("a", [5], 20, [3, 4]), scheduled("b", [6], 16, [1, 2], temperature=0.5)]),
        SchedulerOutput(2, [scheduled("c", list(range(100, 150)), 0, [5, 6, 7, 8]),
                            scheduled("d", [9], 3, [9])], blocks_to_copy=[(41, 42), (43, 44)]),
        SchedulerOutput(3, [scheduled("e", list(range(1, 790)), 0, table)]),  # over INLINE_BYTES
        SchedulerOutput(4, [scheduled(f"s{i}", [i], 30, [50 + i, 60 + i]) for i in range(5)]),
    ]


def test_ranks_rebuild_rank_zeros_layout_byte_for_byte():
    g0, g1 = groups(2)
    builder = StepInputBuilder(StepLimits(block_size=16, num_kv_blocks=128, max_model_len=1024, vocab_size=1000), CPU)
    # The last step is a decode batch padded to a graph bucket of 8 (table width 4).
    built = [builder.build(s) for s in steps()[:-1]] + [builder.build(steps()[-1], lambda n, ctx, uses_lora: (8, 4))]
    assert built[2].layout.nbytes > INLINE_BYTES and built[-1].graph_batch == 8
    got: list = []
    receiver = StepReceiver(g1, pin=False)

    def receive() -> None:
        while True:
            op, step = receiver.next()
            got.append((op, step))
            if op is Op.SHUTDOWN:
                return

    t = threading.Thread(target=receive)
    t.start()
    sender = StepSender(g0, heartbeat_s=60)
    for step in built:
        sender.send_step(step)
        sender.send(Op.HEARTBEAT)
    sender.send(Op.RESET)
    sender.send(Op.SHUTDOWN)
    t.join(30)
    assert [op for op, _ in got] == [Op.STEP, Op.HEARTBEAT] * len(built) + [Op.RESET, Op.SHUTDOWN]
    for sent, (_, step) in zip(built, got[::2], strict=False):
        assert step.layout == sent.layout and torch.equal(step.host, sent.host)
        for name in ("num_tokens", "num_decode", "decode_max_context_len", "prefill_max_query_len",
                     "prefill_max_context_len", "prefill_spans", "num_copies", "graph_batch", "num_real_decodes",
                     "num_sampled"):
            assert getattr(step, name) == getattr(sent, name), name
        assert step.rows == [] and step.owners == []  # sampling is rank 0's alone


def _ranks_in_threads(config: EngineConfig, size: int, capture) -> tuple[ModelRunner, list[threading.Thread]]:
    """Rank 0 here; ranks 1.. in threads serving its broadcasts (as `pagedserve engine-worker` does)."""
    url = f"file://{tempfile.mkdtemp()}/rendezvous"

    def rank(r: int) -> None:
        serve_steps(ModelRunner(config, graph_capture=capture(), group=RankGroup(RankPlace(r, size, r, size, url),
                                                                                 CPU, 20.0)))

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(1, size)]
    for t in threads:
        t.start()
    g0 = RankGroup(RankPlace(0, size, 0, size, url), CPU, 20.0)
    return ModelRunner(config, graph_capture=capture(), group=g0), threads


PROMPTS = {"a": list(range(100, 113)), "b": list(range(200, 231)), "c": list(range(300, 302))}


def _decode(runner, n: int = 6) -> dict[str, list[int]]:
    d = StepDriver(runner)
    for seq_id, prompt in PROMPTS.items():
        d.add(seq_id, prompt)
    for _ in range(n):
        d.step()
    return {k: s.samples for k, s in d.seqs.items()}


@pytest.mark.parametrize("eager", [False, True])
def test_decode_graphs_on_every_rank_give_eager_tokens(tiny_model_dir, eager):
    config = EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=48, max_num_seqs=4,
                          attention_backend="cpu", enforce_eager=eager)
    want = _decode(ModelRunner(dataclasses.replace(config, enforce_eager=True)))
    captures: list[FakeGraphCapture] = []

    def capture() -> FakeGraphCapture:
        captures.append(FakeGraphCapture())
        return captures[-1]

    runner, threads = _ranks_in_threads(config, 2, capture)
    got = _decode(runner)
    runner.close()
    for t in threads:
        t.join(30)
    assert got == want
    assert len(captures) == 2
    if not eager:  # decode steps replayed the graphs of both ranks, whose all-reduces paired up
        assert all(c.captured == 3 and c.replays >= 5 for c in captures), [(c.captured, c.replays) for c in captures]


def test_ranks_given_different_engine_flags_refuse_to_start(tiny_model_dir):
    """Ranks on other machines get their flags on their own: a drift that would mis-pair collectives
    (graph sizes, dtype) or the pool is caught at start-up, by every rank, naming what differs."""
    config = EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=48, max_num_seqs=4,
                          attention_backend="cpu", enforce_eager=True)
    other = dataclasses.replace(config, max_num_seqs=8, num_kv_blocks=40)
    url = f"file://{tempfile.mkdtemp()}/rendezvous"
    errors: list[Exception] = []

    def rank1() -> None:
        try:
            ModelRunner(other, group=RankGroup(RankPlace(1, 2, 1, 2, url), CPU, 20.0))
        except RankGroupError as exc:
            errors.append(exc)

    t = threading.Thread(target=rank1)
    t.start()
    with pytest.raises(RankGroupError, match="the ranks disagree on KV blocks, max num seqs: give every rank"):
        ModelRunner(config, group=RankGroup(RankPlace(0, 2, 0, 2, url), CPU, 20.0))
    t.join(30)
    assert len(errors) == 1 and "KV blocks, max num seqs" in str(errors[0])
