"""The chain positions the prefix index files."""

from hypothesis import given
from hypothesis import strategies as st

from services.registry.index_grid import DENSE, STRIDE, filed, filed_positions


@given(st.integers(0, 300), st.integers(0, 300))
def test_filed_positions_lists_exactly_the_filed_ones(start, end):
    assert filed_positions(start, end) == [p for p in range(start, end) if filed(p)]


def test_the_head_is_dense_and_the_rest_one_in_stride():
    assert all(filed(p) for p in range(DENSE))
    tail = filed_positions(DENSE, DENSE + 100 * STRIDE)
    assert len(tail) == 100 and all(b - a == STRIDE for a, b in zip(tail, tail[1:], strict=False))
