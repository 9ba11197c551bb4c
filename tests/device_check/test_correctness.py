"""How the GPU check judges the engine on the device: every logits row, fed the float32 reference's
tokens, within a bound of the reference's row (a fraction of its RMS); a differing argmax is reported
but never excused or blamed on its own. Its dry run exercises the whole section
(tests/device_check/test_gpu_bundle.py); these are the judge's edge cases, and the reference's weights."""

from __future__ import annotations

import torch

from services.device_check.correctness import LOGIT_BOUND, GreedyRun, compare


def run(*rows: list[float]) -> GreedyRun:
    logits = [torch.tensor(r) for r in rows]
    return GreedyRun([int(r.argmax()) for r in logits], logits)


def test_rows_within_the_bound_pass_and_report_the_distance():
    ref = run([0.0, 2.0, 1.0], [3.0, 0.0, 0.0])
    a = compare({"s": ref}, {"s": run([0.0, 2.01, 1.0], [3.0, 0.0, 0.0])}, 0.05)
    assert a.mismatches == [] and a.rows == 2 and a.argmax_equal == 2
    assert abs(a.max_abs_diff - 0.01) < 1e-6 and abs(a.max_fraction - 0.01 / (5 / 3) ** 0.5) < 1e-6


def test_a_near_tie_that_flips_the_argmax_is_fine_when_the_logits_are_close():
    ref = run([0.0, 2.0, 1.99])
    other = run([0.0, 1.99, 2.0])  # the argmax differs, the logits do not (beyond 0.01)
    a = compare({"s": ref}, {"s": other}, 0.05)
    assert a.mismatches == [] and a.argmax_equal == 0


def test_logits_beyond_the_bound_or_missing_rows_fail_even_with_the_same_argmax():
    ref = run([0.0, 2.0, 1.0], [3.0, 0.0, 0.0])
    far = compare({"s": ref}, {"s": run([0.0, 2.0, 1.5], [3.0, 0.0, 0.0])}, 0.05)
    assert far.argmax_equal == 2 and len(far.mismatches) == 1 and "step 0" in far.mismatches[0]
    short = compare({"s": ref}, {"s": run([0.0, 2.0, 1.0])}, 0.05)
    assert short.mismatches == ["s: 1 rows, not 2"]


def test_the_reference_holds_exactly_the_tested_engines_weights():
    from services.device_check.workload import TINY_LLAMA
    from services.engine.model_loader import RANDOM_DRAW_DTYPE, random_model

    cpu = torch.device("cpu")
    tested = random_model(TINY_LLAMA, torch.bfloat16, cpu, "reference")
    reference = random_model({**TINY_LLAMA, RANDOM_DRAW_DTYPE: "bfloat16"}, torch.float32, cpu, "reference")
    assert reference.embed.dtype == torch.float32 and torch.equal(tested.embed.float(), reference.embed)
    assert set(LOGIT_BOUND) == {"float32", "float16", "bfloat16"}
