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
    many = model.cost(SchedulerOutput(0, [seq(1, 99)] * 64))  # 64 decodes: 8.8 ms of compute, under 17
    # 64 decodes cost their KV reads more than one does, but not 64 weight reads: the GPU regime.
    assert many == pytest.approx(WEIGHT_READ_S + 64 * KV_READ_S_PER_TOKEN * 800) and many < 4 * one
    # A long prefill is compute-bound: it costs more than the weight read.
    assert model.cost(SchedulerOutput(0, [seq(2048, 0)])) > 2 * WEIGHT_READ_S
    assert model.cost(SchedulerOutput(0, [])) == 0 and model.cost(None) == 0


def test_step_costs_by_name():
    assert isinstance(make_step_cost("cpu", 1, 1.0), MeasuredStep)
    assert make_step_cost("cpu", 2, 1.0).name == "measured: wall time"
    assert isinstance(make_step_cost("a100-opt13b", 1, 0.5), ModeledA100Step)
    with pytest.raises(ValueError, match="unknown step cost"):
        make_step_cost("tpu", 1, 1.0)


def test_a_modeled_sweep_is_reported_under_its_name(tiny_llama_dir, tmp_path):
    out = tmp_path / "paper.json"
    rc = main(["bench", "paper", "--model", str(tiny_llama_dir), "--dtype", "float32", "--num-requests", "6",
               "--fractions", "0.5,2", "--scale-sharegpt", "0.0625", "--workloads", "sharegpt",
               "--systems", "pagedserve,orca-max", "--sharing-requests", "0", "--step-cost", "a100-opt13b",
               "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["step_cost"].startswith("modeled: OPT-13B")
    sweep = report["workloads"]["sharegpt"]["systems"]["pagedserve"]["sweep"]
    # Every step costs at least the weight read: no request finishes faster than its tokens' reads.
    assert all(p["normalized_latency"] >= WEIGHT_READ_S for p in sweep)
