"""The sustained-rate search: a bracket found by doubling or halving, then bisected to the asked width;
ratios as the interval both brackets allow; hypothesis drives the predicate's threshold anywhere."""

from hypothesis import given, settings
from hypothesis import strategies as st

from services.bench.paper.rate_search import Bracket, describe_ratio, find_sustained, ratio_bracket, trace_requests


@settings(max_examples=100, deadline=None)
@given(threshold=st.floats(0.01, 1000.0), start=st.floats(0.5, 50.0), width=st.floats(1.02, 1.5))
def test_the_bracket_holds_the_threshold_and_is_as_narrow_as_asked(threshold, start, width):
    tried = []

    def sustains(rate):
        tried.append(rate)
        return rate <= threshold

    floor, ceiling = 0.5 / 64, 50.0 * 64
    b = find_sustained(sustains, start, floor, ceiling, width)
    assert [r for r, _ in b.trials] == tried
    assert all(ok == (r <= threshold) for r, ok in b.trials)  # every trial recorded as it came out
    if b.passed is not None and b.failed is not None:
        assert b.passed <= threshold < b.failed
        assert b.failed / b.passed <= width * 1.001  # four-digit rounding of the tried rates
    elif b.passed is None:
        assert threshold < b.failed and b.failed / 2 < floor * 1.001 or b.failed / 1.4143 < floor
    else:
        assert b.passed <= threshold and (b.passed * 2 > ceiling / 1.001 or b.passed * 1.4143 > ceiling)


def test_a_good_guess_is_bracketed_by_sqrt2_and_a_far_one_by_doubling():
    b = find_sustained(lambda r: r <= 30.0, 25.0, 1.0, 1000.0, 1.10)
    assert b.trials == [(25.0, True), (35.36, False), (29.73, True), (32.42, False)]
    assert b.passed == 29.73 and b.failed == 32.42 and b.width <= 1.10
    far = find_sustained(lambda r: r <= 5.0, 30.0, 1.0, 1000.0, 1.10)
    assert [r for r, _ in far.trials][:4] == [30.0, 21.21, 10.61, 5.305]  # down by sqrt(2), then halving
    assert far.passed <= 5.0 < far.failed and far.width <= 1.10


def test_ratios_are_the_interval_both_brackets_allow():
    a, b = Bracket(passed=20.0, failed=22.0), Bracket(passed=10.0, failed=11.0)
    assert ratio_bracket(a, b) == {"low": 1.818, "high": 2.2}
    assert describe_ratio(ratio_bracket(a, b)) == "1.82-2.20x"
    open_top = Bracket(passed=100.0, failed=None)  # sustained up to the ceiling
    assert describe_ratio(ratio_bracket(open_top, b)) == "> 9.09x"
    nothing = Bracket(passed=None, failed=1.0)  # not even the floor
    assert describe_ratio(ratio_bracket(a, nothing)) == "> 20.00x"
    assert describe_ratio(ratio_bracket(nothing, b)) == "< 0.10x"
    assert describe_ratio(ratio_bracket(open_top, open_top)) == "unbounded (both brackets open)"


def test_traces_are_as_long_in_time_at_every_rate():
    assert trace_requests(10.0, 30.0, 50) == 300 and trace_requests(100.0, 30.0, 50) == 3000
    assert trace_requests(1.0, 30.0, 50) == 50  # a low rate runs longer than 30 s instead of judging 30 requests
