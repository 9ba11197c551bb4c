"""The change stream's entry: a load written for one replica and generation is read back only for that
replica and generation, only with the token it was signed with, and only unaltered."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from services.contracts.internal_auth import InternalToken
from services.registry.change_entry import carries_load, entry_fields, entry_load, entry_replica
from services.registry.model import ReplicaLoad

TOKEN = InternalToken.generate()


def test_a_signed_load_reads_back_for_its_replica_and_generation_only():
    load = ReplicaLoad(1, 3, 0.25, True, 200)
    fields = entry_fields("a", (7, load), TOKEN)
    assert entry_replica(fields) == "a" and carries_load(fields)
    assert entry_load(fields, "a", 7, TOKEN) == load
    assert entry_load(fields, "b", 7, TOKEN) is None  # another replica's
    assert entry_load(fields, "a", 8, TOKEN) is None  # another generation's
    assert entry_load(fields, "a", 7, InternalToken.generate()) is None  # another cluster's token
    assert entry_load({**fields, "l": ReplicaLoad(0, 0).to_compact()}, "a", 7, TOKEN) is None  # altered
    assert entry_load(entry_fields("a", (7, load), None), "a", 7, TOKEN) is None  # unsigned
    assert entry_load(entry_fields("a", (7, load), None), "a", 7, None) == load  # no token in use


def test_an_entry_without_a_load_names_only_its_replica():
    fields = entry_fields("a", None, TOKEN)
    assert fields == {"r": "a"} and not carries_load(fields) and entry_load(fields, "a", 0, TOKEN) is None


@given(st.dictionaries(st.sampled_from(["r", "l", "g", "s", b"r", b"l", b"g", b"s"]),
                       st.text(max_size=30) | st.binary(max_size=30)))
def test_any_entry_read_back_is_a_load_or_none(fields):
    """Whatever a stream holds (written by anyone with access to Redis): no exception, and nothing but a
    sane load or None."""
    rid = entry_replica(fields)
    assert rid is None or isinstance(rid, str)
    load = entry_load(fields, rid or "a", 0, None)
    assert load is None or isinstance(load, ReplicaLoad)
