"""What a step costs on bench paper's virtual clock: the A100 roofline model, and a sweep run on it."""

import json

import pytest

from services.bench.paper.step_cost import (
    KV_READ_S_PER_TOKEN,
    WEIGHT_READ_S,
    MeasuredStep,
    ModeledA100Step,
    make_step_cost,
)
from services.commands.cli import main
from services.contracts.step_protocol import SamplingSpec, ScheduledSequence, SchedulerOutput


def seq(new: int, start: int) -> ScheduledSequence:
    return ScheduledSequence("s", list(range(new)), start, [0], True, SamplingSpec())


def test_a_decode_step_costs_the_weight_read_plus_its_kv_whatever_the_batch_up_to_the_roofline():
    model = ModeledA100Step(scale=0.125)
    one = model.cost(SchedulerOutput(0, [seq(1, 99)]))
    assert one == pytest.approx(WEIGHT_READ_S + KV_READ_S_PER_TOKEN * 100 * 8)
    many = model.cost(SchedulerOutput(0, [seq(1, 99)] * 64))  # 64 decodes: ~9.5 ms of compute, under 17
    # 64 decodes cost their KV reads more than one does, but not 64 weight reads: the GPU regime.
    assert many == pytest.approx(WEIGHT_READ_S + 64 * KV_READ_S_PER_TOKEN * 800) and many < 4 * one
    # A long prefill is compute-bound: it costs more than the weight read.
    assert model.cost(SchedulerOutput(0, [seq(2048, 0)])) > 2 * WEIGHT_READ_S
    assert model.cost(SchedulerOutput(0, [])) == 0 and model.cost(None) == 0
    # Attention's FLOPs count: a prefill's grow with the square of its length, beyond its tokens' GEMMs.
    long, short = (model.cost(SchedulerOutput(0, [seq(n, 0)])) for n in (256, 128))
    assert long > 2 * short
    assert model.kind == "modeled" and "uncalibrated roofline" in model.name


def test_step_costs_by_name():
    assert isinstance(make_step_cost("cpu", 1, 1.0), MeasuredStep)
    assert make_step_cost("cpu", 2, 1.0).name == "measured: wall time"
    assert isinstance(make_step_cost("a100-opt13b", 1, 0.5), ModeledA100Step)
    with pytest.raises(ValueError, match="unknown step cost"):
        make_step_cost("tpu", 1, 1.0)


def test_a_modeled_sweep_is_reported_under_its_name(tiny_llama_dir, tmp_path):
    out = tmp_path / "paper.json"
    rc = main(["bench", "paper", "--model", str(tiny_llama_dir), "--dtype", "float32", "--trace-requests", "12",
               "--min-requests", "8", "--bracket", "1.5", "--scale-sharegpt", "0.0625", "--workloads", "sharegpt",
               "--systems", "pagedserve,orca-max", "--sharing-requests", "0", "--step-cost", "a100-opt13b",
               "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["clock"]["kind"] == "modeled" and "uncalibrated roofline" in report["clock"]["name"]
    d = report["workloads"]["sharegpt"]
    assert "modeled_sustained_rps" in d["systems"]["pagedserve"] and "modeled_latency_bound_s_per_token" in d
    assert not any("measured" in k for t in d["systems"]["pagedserve"]["trials"] for k in t)
    # Every step costs at least the weight read: no request finishes faster than its tokens' reads.
    assert all(t["modeled_normalized_latency"] >= WEIGHT_READ_S for t in d["systems"]["pagedserve"]["trials"])
