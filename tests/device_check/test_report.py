"""The GPU check's table survives its own failures: a section that raises is one FAILED row naming the
error's type, the next section runs, and the table file holds every row as it was added. The run passes
only if everything ran: a skipped, timed-out or missing section, or a skipped measurement, fails it; no
section is ever interrupted (a signal could land inside a graph capture or a compile)."""

from __future__ import annotations

import time

from services.device_check.report import Report, describe_error


def test_a_failed_section_is_a_row_and_the_rest_runs(tmp_path):
    table = tmp_path / "table.md"
    report = Report(budget_s=60, table_path=table)

    def boom():
        report.add("first", "measured before the error", "1")
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore detail")

    def fine():
        report.add("second", "still measured", "2")

    assert not report.section("first", 10, boom)
    assert report.section("second", 10, fine)
    failed = [r for r in report.rows if r.value == "FAILED"]
    assert [(r.section, r.note) for r in failed] == [
        ("first", "RuntimeError: CUDA error: an illegal memory access was encountered")]
    assert report.failures == ["first: RuntimeError: CUDA error: an illegal memory access was encountered"]
    text = table.read_text()
    assert "| first | measured before the error | 1 |" in text and "| second | still measured | 2 |" in text
    assert {t["section"] for t in report.timings} == {"first", "second"}


def test_a_section_past_its_limit_finishes_and_fails_the_run(tmp_path):
    report = Report(budget_s=60, table_path=tmp_path / "t.md")
    report.plan(["slow"])
    finished = []

    def slow():  # stands for a graph capture: it must not be interrupted
        time.sleep(0.5)
        finished.append(True)

    assert not report.section("slow", 0.2, slow)
    assert finished == [True]
    assert len(report.verdict()) == 1 and report.verdict()[0].startswith("slow: timed out")
    assert not report.finish()


def test_skipped_missing_and_unmeasured_sections_fail_the_run(tmp_path):
    table = tmp_path / "t.md"
    report = Report(budget_s=60, table_path=table, force_skip=frozenset({"forced"}))
    report.plan(["fine", "forced", "never reached"])
    assert report.section("fine", 10, lambda: None)
    assert not report.section("forced", 10, lambda: None)
    verdict = report.verdict()
    assert verdict == ["forced: not run (forced to skip (--force-skip))", "never reached: did not run"]
    assert not report.finish()
    last = table.read_text().strip().splitlines()[-1]
    assert last.startswith("verdict: FAILED") and "never reached: did not run" in last

    done = Report(budget_s=60, table_path=tmp_path / "ok.md")
    done.plan(["only"])
    assert done.section("only", 10, lambda: None) and done.finish()
    assert (tmp_path / "ok.md").read_text().strip().endswith("all 1 planned sections ran and passed")


def test_a_spent_run_skips_sections_and_out_of_time_stops_measurements(tmp_path):
    report = Report(budget_s=0, table_path=None)
    assert not report.section("late", 30, lambda: None)
    assert report.rows[-1].value == "SKIPPED" and report.failures[-1].startswith("late: not run")
    report.section_deadline = 0
    assert report.out_of_time("anything")
    assert report.failures[-1] == "anything: not measured (time budget spent)"


def test_errors_are_named_by_their_type():
    assert describe_error(ValueError("bad\nworse")) == "ValueError: bad"
    assert describe_error(RuntimeError("")) == "RuntimeError"
    import torch

    assert describe_error(torch.OutOfMemoryError("CUDA out of memory")).startswith("torch.OutOfMemoryError: CUDA")
