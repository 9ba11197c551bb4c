"""How the GPU check judges two greedy runs on the device: equal tokens, or a parting at a near-tie of the
reference's top two logits (both tokens right), never any other difference. Its dry run exercises the
whole section (tests/device_check/test_gpu_bundle.py); these are the judge's edge cases."""

from __future__ import annotations

import torch

from services.device_check.correctness import GreedyRun, compare


def run(*rows: list[float]) -> GreedyRun:
    logits = [torch.tensor(r) for r in rows]
    return GreedyRun([int(r.argmax()) for r in logits], logits)


def test_equal_runs_agree_and_report_the_logit_difference():
    a = compare({"s": run([0.0, 2.0, 1.0], [3.0, 0.0, 0.0])}, {"s": run([0.0, 2.01, 1.0], [3.0, 0.0, 0.0])}, 0.1)
    assert a.mismatches == [] and a.equal == a.steps == 2 and a.ties == 0
    assert abs(a.max_logit_diff - 0.01) < 1e-6


def test_a_parting_at_a_near_tie_is_not_a_failure():
    ref = run([0.0, 2.0, 1.95], [3.0, 0.0, 0.0])
    other = run([0.0, 1.94, 1.96], [0.0, 0.0, 5.0])  # parted at step 0; step 1 is not compared
    a = compare({"s": ref}, {"s": other}, tolerance=0.1)
    assert a.mismatches == [] and a.ties == 1 and a.equal == 0


def test_a_clear_difference_or_a_short_run_fails():
    ref = run([0.0, 2.0, 1.0], [3.0, 0.0, 0.0])
    a = compare({"s": ref}, {"s": run([0.0, 1.0, 2.0], [3.0, 0.0, 0.0])}, tolerance=0.1)
    assert len(a.mismatches) == 1 and "logit gap 1.000" in a.mismatches[0]
    short = compare({"s": ref}, {"s": run([0.0, 2.0, 1.0])}, tolerance=0.1)
    assert short.mismatches == ["s: 1 tokens, not 2"]
