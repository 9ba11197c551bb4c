"""The GPU check's table survives its own failures: a section that raises or overruns is one FAILED row
naming the error's type, the next section runs, and the table file holds every row as it was added."""

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


def test_a_section_past_its_hard_limit_is_stopped(tmp_path):
    report = Report(budget_s=60, table_path=tmp_path / "t.md")
    started = time.monotonic()
    assert not report.section("slow", 0.2, time.sleep, 30)
    assert time.monotonic() - started < 5
    assert "SectionTimeout" in report.failures[0]


def test_a_spent_run_skips_sections_and_out_of_time_stops_measurements(tmp_path):
    report = Report(budget_s=0, table_path=None)
    assert not report.section("late", 30, lambda: None)
    assert report.rows[-1].value == "SKIPPED"
    report.section_deadline = 0
    assert report.out_of_time("anything")


def test_errors_are_named_by_their_type():
    assert describe_error(ValueError("bad\nworse")) == "ValueError: bad"
    assert describe_error(RuntimeError("")) == "RuntimeError"
    import torch

    assert describe_error(torch.OutOfMemoryError("CUDA out of memory")).startswith("torch.OutOfMemoryError: CUDA")
