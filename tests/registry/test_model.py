"""The registry's wire forms: a load's compact form (the change stream's) round-trips, and any other text is
refused with a ValueError, never another exception or a load that breaks the routers' sort orders."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.registry.model import ReplicaLoad

loads = st.builds(ReplicaLoad, st.integers(0, 10**6), st.integers(0, 10**6),
                  st.floats(0, 1, allow_nan=False), st.booleans(), st.integers(0, 10**9))


@given(loads)
def test_a_compact_load_round_trips(load):
    assert ReplicaLoad.from_compact(load.to_compact()) == load


@given(st.text(alphabet=st.sampled_from("0123456789,.-+einfa x"), max_size=40) | st.text(max_size=40))
def test_anything_else_is_a_value_error_or_a_sane_load(text):
    try:
        load = ReplicaLoad.from_compact(text)
    except ValueError:
        return
    assert min(load.num_waiting, load.num_running, load.cached_blocks) >= 0 and math.isfinite(load.kv_usage)


@pytest.mark.parametrize("text", ["0,1,nan,1,0", "0,1,inf,1,0", "-1,0,0.0,1,0", "0,0,0.0,2,0", "0,0,0.0,1", ""])
def test_what_from_compact_refuses(text):
    with pytest.raises(ValueError):
        ReplicaLoad.from_compact(text)
