"""The default-path guard: the scheduler and the engine cost per step what they did, as ratios to references
measured in the same run (services/bench/offline/default_path_guard.py), and the guard fails on purpose
when a per-step cost is added.

A change that adds work to every step of the default path (the Llama model, no LoRA, no speculation, no
quantization) fails here: either its steps or tokens differ from the reference schedule's, or its CPU
time per step, over the reference's, passes the budget (the ratio measured when the budget was set, plus
the tolerance stated in default_path_guard.py). A change that must cost more says so by raising the
measured ratio there, in its own commit, with its reason.
"""

import pytest

from services.bench.offline import default_path_guard as guard
from services.bench.offline.reference_scheduler import run_reference
from services.bench.offline.workloads import offline_workload


def _failed(results) -> list[str]:
    return [c.name for r in results for c in guard.checks(r) if not c.passed]


@pytest.fixture(scope="module")
def tokenizer():
    return guard._tokenizer()


@pytest.fixture(scope="module")
def engine():
    return guard.build_engine()


def _measure(part: str, trace: str, tokenizer, engine, repeats: int):
    if part == "scheduler":
        return guard.measure_scheduler(trace, repeats, tokenizer)
    return guard.measure_engine(trace, repeats, engine, tokenizer)


def _within_budget(part: str, trace: str, tokenizer, engine):
    """Measure; a CPU ratio past the budget is measured once more (a burst of load on a shared machine
    can land on one run's measured part more than on its reference), the counts never are."""
    result = _measure(part, trace, tokenizer, engine, repeats=5)
    failed = _failed([result])
    if failed and all("CPU per step" in name for name in failed):
        result = _measure(part, trace, tokenizer, engine, repeats=7)
        failed = _failed([result])
    return result, failed


@pytest.mark.parametrize("part", ["scheduler", "engine"])
@pytest.mark.parametrize("trace", ["w1", "w3"])
def test_the_default_path_costs_per_step_what_it_did(part, trace, tokenizer, engine):
    result, failed = _within_budget(part, trace, tokenizer, engine)
    assert not failed, (f"{failed}: ratios {[round(x, 3) for x in result.ratios]}, budget "
                        f"{guard.scheduler_budget(trace) if part == 'scheduler' else guard.engine_budget(trace):.3f}")
    # The traces have their shapes: W1 runs every request at once, W3 reuses each group's prefix.
    if trace == "w3":
        assert result.counts.prefix_hit_tokens > 0.6 * sum(len(r.prompt_token_ids) for r in
                                                           guard.guard_trace("w3", part))


@pytest.mark.parametrize("part", ["scheduler", "engine"])
def test_the_guard_fails_on_a_deliberately_added_per_step_cost(part, tokenizer, engine):
    """`pagedserve bench guard --inject scheduler|engine` does the same from the command line."""
    want = [f"{part} w1: CPU per step / reference's"]
    with guard.added_cost(part):
        result = _measure(part, "w1", tokenizer, engine, repeats=3)
        if _failed([result]) != want:
            # A burst of load landing on the reference's runs can hide the cost once (seen once in a busy
            # make test); measured again with more repeats, as _within_budget does the other way round.
            result = _measure(part, "w1", tokenizer, engine, repeats=7)
    assert _failed([result]) == want, result.ratios


def test_the_reference_schedule_is_the_schedulers_own():
    """The reference loop reproduces the scheduler's schedule exactly on both shapes (so a change in the
    real one's step count or tokens is a change in policy, never noise)."""
    w1 = run_reference(offline_workload("w1", 2048), 2048, 256)
    assert (w1.steps, w1.scheduled_tokens, w1.prefix_hit_tokens, w1.output_tokens) == (132, 16320, 0, 8192)
    # 8 groups x 12 requests sharing 384 tokens: 11 of each 12 reuse the 24 prefix blocks.
    w3 = run_reference(offline_workload("w3", 2048), 2048, 256)
    assert w3.prefix_hit_tokens == 8 * 11 * 384 and w3.output_tokens == 96 * 64


def test_guard_command_reports_and_exits_by_its_checks(tmp_path, monkeypatch):
    import json

    from services.commands.cli import main

    out = tmp_path / "guard.json"
    monkeypatch.setattr(guard, "run_guard", lambda **kw: _only_scheduler_w1(**kw))
    assert main(["bench", "guard", "--repeats", "3", "--json", str(out)]) in (0, 1)
    report = json.loads(out.read_text())
    assert report["results"][0]["part"] == "scheduler" and report["checks"]


def _only_scheduler_w1(repeats, inject):
    with guard.added_cost(inject):
        results = [guard.measure_scheduler("w1", repeats)]
    return results, [c for r in results for c in guard.checks(r)]
