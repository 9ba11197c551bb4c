"""Step inputs: the layout the kernels read (checked against a plain recomputation), and validation of
everything a step carries: a bad field raises InvalidStepError naming the sequence and the field before
any kernel runs, bystanders are not named, and hostile values (hypothesis, aimed at every range's
boundaries) never get past the checks nor crash them."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.contracts.step_protocol import InvalidStepError, PenaltySpec, SchedulerOutput, StepFault
from services.device_check.step_driver import scheduled
from services.engine.config import EngineConfig
from services.engine.model_runner import ModelRunner
from services.engine.step_inputs import StepInputBuilder
from services.engine.step_validation import StepLimits, find_faults

LIMITS = StepLimits(block_size=16, num_kv_blocks=64, max_model_len=512, vocab_size=1000)


def builder() -> StepInputBuilder:
    return StepInputBuilder(LIMITS, torch.device("cpu"))


def valid_step() -> SchedulerOutput:
    """Two decodes (the second sorts first by its first block), a fresh prompt, a continuation chunk
    and a fork of two samples."""
    out = SchedulerOutput(7, [
        scheduled("d1", [5], 20, [9, 10]),
        scheduled("d2", [6], 16, [3, 4], temperature=0.7, top_p=0.9, top_k=50, seed=3, logprobs=2, banned=[2, 999]),
        scheduled("fresh", [11, 12, 13], 0, [20]),
        scheduled("chunk", list(range(100, 120)), 30, [30, 31, 32, 33], sample=False),
        scheduled("fork", [7, 8, 9, 10, 11], 0, [40], num_samples=2),
    ], blocks_to_copy=[(41, 42)])
    out.sequences[1].penalties = PenaltySpec(0.5, -0.5, 1.2, 0.1, [3, 999], [-100.0, 2.5], [6, 6, 7], [1, 2])
    return out


def test_layout_is_what_the_kernels_read():
    out = valid_step()
    step = builder().build(out)
    t = step.layout.tensors(step.host)
    assert step.num_decode == 2 and step.num_tokens == 2 + 3 + 20 + 5
    assert t.input_ids.tolist() == [6, 5, 11, 12, 13, *range(100, 120), 7, 8, 9, 10, 11]
    assert t.positions.tolist() == [16, 20, 0, 1, 2, *range(30, 50), 0, 1, 2, 3, 4]
    assert t.decode_block_tables[0].tolist() == [[3, 4], [9, 10]]  # sorted by first block
    assert t.decode_context_lens.tolist() == [17, 21]
    assert t.decode_block_tables.dtype == t.decode_context_lens.dtype == torch.int32
    assert t.prefill_query_start_loc.tolist() == [0, 3, 23, 28]
    assert t.prefill_context_lens.tolist() == [3, 50, 5]
    assert t.prefill_block_tables[0].tolist() == [[20, 0, 0, 0], [30, 31, 32, 33], [40, 0, 0, 0]]
    want_slots = [4 * 16 + 0, 10 * 16 + 4, 320, 321, 322]
    want_slots += [[30, 31, 32, 33][p // 16] * 16 + p % 16 for p in range(30, 50)]
    want_slots += [640 + i for i in range(5)]
    assert t.slot_mapping.tolist() == [want_slots]  # one KV group
    # Rows to sample: each sampling sequence's last token, the fork twice; "chunk" does not sample.
    assert t.sample_idx.tolist() == [0, 1, 4, 29, 29]
    assert step.owners == ["d2", "d1", "fresh", "fork", "fork"]
    assert [r.sample_index for r in step.rows] == [0, 0, 0, 0, 1]
    assert step.rows[0].banned == [2, 999] and step.rows[1].banned == []
    assert step.rows[0].penalties is out.sequences[1].penalties and step.rows[1].penalties is None
    assert (t.copy_src.tolist(), t.copy_dst.tolist()) == ([41], [42])
    assert step.prefill_spans == [(0, 3, 3), (3, 23, 50), (23, 28, 5)]
    assert (step.decode_max_context_len, step.prefill_max_query_len, step.prefill_max_context_len) == (21, 20, 50)
    assert step.host.dtype == torch.uint8 and step.host.numel() == step.layout.nbytes


def mutate(field: str, value, seq: int = 0) -> SchedulerOutput:
    out = valid_step()
    s = out.sequences[seq]
    if field.startswith("sampling."):
        setattr(s.sampling, field.split(".", 1)[1], value)
    elif field.startswith("penalties."):
        name = field.split(".", 1)[1]
        if s.penalties is None:
            s.penalties = PenaltySpec(0.5, -0.5, 1.2, 0.1, [3], [1.0], [6], [1])
        if name.endswith("[0]"):
            getattr(s.penalties, name[:-3])[0] = value
        else:
            setattr(s.penalties, name, value)
    elif field == "token_ids[0]":
        s.token_ids[0] = value
    elif field == "block_table[0]":
        s.block_table[0] = value
    else:
        setattr(s, field, value)
    return out


BAD = [
    ("token_ids[0]", 1000, "token_ids"), ("token_ids[0]", -1, "token_ids"), ("token_ids[0]", 2 ** 64, "token_ids"),
    ("token_ids[0]", 1.0, "token_ids"), ("token_ids[0]", "7", "token_ids"), ("token_ids", [], "token_ids"),
    ("block_table[0]", 64, "block_table"), ("block_table[0]", -1, "block_table"),
    ("block_table[0]", 2 ** 40, "block_table"), ("block_table[0]", None, "block_table"),
    ("block_table", [9], "block_table"), ("start_pos", -1, "start_pos"), ("start_pos", 512, "start_pos"),
    ("start_pos", 2.0, "start_pos"), ("sample", 1, "sample"), ("num_samples", 0, "num_samples"),
    ("num_samples", 10 ** 6, "num_samples"), ("sample_index", -1, "sample_index"),
    ("output_index", 2 ** 63, "output_index"),
    ("sampling.temperature", math.nan, "sampling.temperature"),
    ("sampling.temperature", math.inf, "sampling.temperature"),
    ("sampling.temperature", -0.5, "sampling.temperature"), ("sampling.temperature", "0", "sampling.temperature"),
    ("sampling.top_p", 0.0, "sampling.top_p"), ("sampling.top_p", 1.5, "sampling.top_p"),
    ("sampling.top_p", math.nan, "sampling.top_p"), ("sampling.top_k", -2, "sampling.top_k"),
    ("sampling.top_k", 2 ** 63, "sampling.top_k"), ("sampling.top_k", 3.0, "sampling.top_k"),
    ("sampling.seed", 2 ** 64, "sampling.seed"), ("sampling.seed", -(2 ** 63) - 1, "sampling.seed"),
    ("sampling.seed", 10 ** 5000, "sampling.seed"), ("sampling.logprobs", 1001, "sampling.logprobs"),
    ("sampling.logprobs", -1, "sampling.logprobs"), ("seq_id", 5, "seq_id"),
    ("banned_token_ids", [2, -1], "banned_token_ids"), ("banned_token_ids", [2.0], "banned_token_ids"),
    ("banned_token_ids", None, "banned_token_ids"), ("banned_token_ids", list(range(1001)), "banned_token_ids"),
    ("token_bitmask", b"\xff" * 127, "token_bitmask"), ("token_bitmask", b"\xff" * 132, "token_bitmask"),
    ("token_bitmask", "\xff" * 128, "token_bitmask"), ("token_bitmask", [-1] * 32, "token_bitmask"),
    ("penalties.presence_penalty", 2.5, "penalties.presence_penalty"),
    ("penalties.frequency_penalty", math.nan, "penalties.frequency_penalty"),
    ("penalties.repetition_penalty", 0.0, "penalties.repetition_penalty"),
    ("penalties.repetition_penalty", math.inf, "penalties.repetition_penalty"),
    ("penalties.min_p", 1.5, "penalties.min_p"), ("penalties.min_p", "0", "penalties.min_p"),
    ("penalties.bias_token_ids[0]", 1000, "penalties.bias_token_ids"),
    ("penalties.bias_token_ids", list(range(301)), "penalties.bias_token_ids"),
    ("penalties.bias_values[0]", 101.0, "penalties.bias_values"),
    ("penalties.bias_values", [1.0], "penalties.bias_values"),
    ("penalties.output_token_ids[0]", -1, "penalties.output_token_ids"),
    ("penalties.output_token_ids", list(range(513)), "penalties.output_token_ids"),
    ("penalties.prompt_token_ids[0]", 1000, "penalties.prompt_token_ids"),
    ("penalties.prompt_token_ids", None, "penalties.prompt_token_ids"),
]


@pytest.mark.parametrize("field,value,named", BAD, ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(BAD)])
def test_a_bad_field_names_its_sequence_and_field(field, value, named):
    seq = 1 if field.startswith(("sampling", "penalties")) else 0  # d2 samples with every parameter set
    out = mutate(field, value, seq)
    with pytest.raises(InvalidStepError) as info:
        builder().build(out)
    err = info.value
    bad_id = out.sequences[seq].seq_id
    bad_id = bad_id if isinstance(bad_id, str) else repr(bad_id)
    assert err.seq_ids == [bad_id], f"bystanders named: {err.seq_ids}"
    assert named in [f.field for f in err.faults], err.faults
    assert isinstance(err, ValueError) and bad_id in str(err) and named in str(err)


def test_step_level_faults():
    out = valid_step()
    out.sequences[1].seq_id = "d1"
    assert {f.field for f in _faults(out)} == {"seq_id"}
    out = valid_step()
    out.sequences[2].block_table = [10]  # "fresh" writes block 10 slot 0..2; d1 writes block 10 slot 4
    out.sequences[2].start_pos = 2  # now slots 162..164: d1's 164 too
    err = _raises(out)
    assert err.seq_ids == ["fresh"] and "also written by 'd1'" in str(err)
    for pairs, why in ((([41, 41],), "onto itself"), (([41, 42], [43, 42]), "destination of 2"),
                       (([41, 42], [42, 43]), "both a source"), (([41, 64],), "outside")):
        out = valid_step()
        out.blocks_to_copy = [tuple(p) for p in pairs]
        err = _raises(out)
        assert why in str(err) and {f.field for f in err.faults} == {"blocks_to_copy"}
    out = valid_step()
    out.blocks_to_copy = [(40, 40)]  # "fork" owns block 40: its request is the one to fail
    assert _raises(out).seq_ids == ["fork"]


def _faults(out) -> list[StepFault]:
    return _raises(out).faults


def _raises(out) -> InvalidStepError:
    with pytest.raises(InvalidStepError) as info:
        builder().build(out)
    return info.value


HOSTILE = st.sampled_from([
    -1, 0, 1, 15, 16, 17, 63, 64, 511, 512, 999, 1000, 2 ** 31 - 1, 2 ** 31, 2 ** 63 - 1, 2 ** 63, 2 ** 64,
    -(2 ** 63), -(2 ** 63) - 1, 10 ** 40, 0.0, 0.5, 1.0, 1.5, -0.0, math.nan, math.inf, -math.inf, 1e-320,
    True, False, None, "3", b"3", [], [3], (), {},
])
FIELDS = st.sampled_from(["token_ids[0]", "block_table[0]", "start_pos", "sample", "num_samples", "sample_index",
                          "output_index", "sampling.temperature", "sampling.top_p", "sampling.top_k",
                          "sampling.seed", "sampling.logprobs", "token_ids", "block_table", "seq_id",
                          "banned_token_ids", "token_bitmask", "penalties.presence_penalty",
                          "penalties.repetition_penalty", "penalties.min_p", "penalties.bias_token_ids[0]",
                          "penalties.bias_values[0]", "penalties.output_token_ids[0]", "penalties.prompt_token_ids"])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(FIELDS, HOSTILE, st.integers(0, 4)), min_size=1, max_size=3))
def test_hostile_values_are_refused_by_the_fast_check_exactly_when_a_field_is_out_of_range(mutations):
    out = valid_step()
    for field, value, seq in mutations:
        part = copy.deepcopy(mutate(field, value, seq).sequences[seq])
        out.sequences[seq] = part
    faults = find_faults(out, LIMITS)
    try:
        step = builder().build(out)
    except InvalidStepError as e:
        assert faults, f"refused a step the field-by-field check accepts: {e}"
        assert e.faults == faults
        return
    assert not faults, f"accepted a step with faults: {faults}"
    t = step.layout.tensors(step.host)
    # Whatever was accepted stays inside the pool, the vocabulary and the RoPE table.
    assert t.input_ids.min() >= 0 and t.input_ids.max() < LIMITS.vocab_size
    assert t.slot_mapping.min() >= 0 and t.slot_mapping.max() < LIMITS.num_kv_blocks * LIMITS.block_size
    assert t.positions.max() < LIMITS.max_model_len
    for table in (t.decode_block_tables, t.prefill_block_tables):
        assert not table.numel() or (table.min() >= 0 and table.max() < LIMITS.num_kv_blocks)


def test_an_invalid_step_touches_nothing_and_the_engine_goes_on(tiny_model_dir):
    runner = ModelRunner(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=32))
    ok = SchedulerOutput(1, [scheduled("a", [5, 6, 7], 0, [0]), scheduled("b", [8, 9], 0, [1])])
    bad = copy.deepcopy(ok)
    bad.sequences[1].block_table = [32]  # one past the pool
    before = runner.arena.clone()
    with pytest.raises(InvalidStepError) as info:
        runner.execute(bad)
    assert info.value.seq_ids == ["b"]
    assert torch.equal(runner.arena, before), "a refused step wrote KV"
    assert set(runner.execute(ok).sampled) == {"a", "b"}


def test_validation_cost_per_step():
    """The checks ride along with building the step: measured here for 256 decodes with 64-block tables
    (printed with -s; the bound only catches an accidental per-token Python loop)."""
    import time

    limits = StepLimits(block_size=16, num_kv_blocks=70000, max_model_len=4096, vocab_size=128256)
    b = StepInputBuilder(limits, torch.device("cpu"))
    rng = np.random.default_rng(0)
    seqs = [scheduled(f"s{i}", [int(rng.integers(0, 128256))], 1000, list(range(i * 64, i * 64 + 64)))
            for i in range(256)]
    out = SchedulerOutput(1, seqs)
    b.build(out)
    start = time.perf_counter()
    for _ in range(20):
        b.build(out)
    per_step = (time.perf_counter() - start) / 20
    print(f"StepInputBuilder.build: {per_step * 1e3:.2f} ms for 256 decodes x 64 blocks")
    assert per_step < 0.05
