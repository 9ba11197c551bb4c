"""Tensor-parallel shard plans: for every head layout and size (hypothesis), the ranks' query heads,
MLP rows and vocabulary rows partition the model exactly, every rank reads the KV heads its query
heads use (replicated when the size exceeds the KV heads, as vLLM does), and a size that does not fit
is refused with the reason and the sizes that would."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.engine.tp_shard import TensorParallelConfigError, TensorParallelShard, valid_sizes


def plan(size: int, rank: int, heads=9, kv=3, inter=1536, vocab=49152, head_dim=64) -> TensorParallelShard:
    return TensorParallelShard.plan(num_heads=heads, num_kv_heads=kv, head_dim=head_dim, intermediate=inter,
                                    vocab_size=vocab, size=size, rank=rank)


@st.composite
def layouts(draw):
    kv = draw(st.sampled_from([1, 2, 3, 4, 8]))
    heads = kv * draw(st.integers(1, 8))
    size = draw(st.sampled_from([n for n in range(1, 17)
                                 if heads % n == 0 and (kv % n == 0 or n % kv == 0)]))
    inter = size * draw(st.integers(1, 64))
    vocab = draw(st.integers(size, 5000))
    return heads, kv, inter, vocab, size


@given(layouts())
def test_ranks_partition_the_model(layout):
    heads, kv, inter, vocab, size = layout
    shards = [plan(size, r, heads, kv, inter, vocab, head_dim=8) for r in range(size)]
    covered = [h for s in shards for h in range(s.head_start, s.head_start + s.num_heads)]
    assert covered == list(range(heads))
    rows = [r for s in shards for r in range(*s.mlp_rows)]
    assert rows == list(range(inter))
    vocab_rows = [r for s in shards for r in range(*s.vocab_rows)]
    assert vocab_rows == list(range(vocab))
    assert len({s.vocab_shard for s in shards}) == 1 and shards[0].vocab_shard * size >= vocab
    group = heads // kv  # query heads per KV head in the model
    for s in shards:
        assert s.q_rows == (s.head_start * 8, (s.head_start + s.num_heads) * 8)
        needed = {h // group for h in range(s.head_start, s.head_start + s.num_heads)}
        held = set(range(s.kv_head_start, s.kv_head_start + s.num_kv_heads))
        assert needed == held, f"rank {s.rank} holds KV heads {held}, its queries read {needed}"
    if size > kv:
        assert all(s.num_kv_heads == 1 and s.kv_replicas == size // kv for s in shards)
        # Each KV head is held by exactly kv_replicas consecutive ranks.
        assert [s.kv_head_start for s in shards] == [r // (size // kv) for r in range(size)]


def test_smollm2_at_two_ranks_is_refused_with_the_sizes_that_fit():
    with pytest.raises(TensorParallelConfigError) as err:
        plan(2, 0)
    message = str(err.value)
    assert "does not divide the model's 9 attention heads" in message
    assert message.endswith("sizes that fit this model: 1, 3")
    assert valid_sizes(9, 3, 1536) == [1, 3]


def test_smollm2_at_three_ranks_holds_three_heads_and_one_kv_head_each():
    shards = [plan(3, r) for r in range(3)]
    assert [(s.num_heads, s.num_kv_heads, s.kv_head_start, s.intermediate) for s in shards] == [
        (3, 1, 0, 512), (3, 1, 1, 512), (3, 1, 2, 512)]
    assert all(s.kv_replicas == 1 and s.vocab_shard == 16384 for s in shards)


def test_kv_heads_that_do_not_split_are_refused():
    # 24 heads over 6 KV heads at size 4: the heads split, the KV heads do not.
    with pytest.raises(TensorParallelConfigError, match="does not divide the model's 6 KV heads"):
        plan(4, 0, heads=24, kv=6, inter=64)


def test_a_size_past_the_kv_heads_must_be_a_multiple_of_them():
    with pytest.raises(TensorParallelConfigError, match="not a multiple of them"):
        plan(6, 0, heads=12, kv=4, inter=60)
    assert plan(8, 5, heads=16, kv=4, inter=64).kv_head_start == 2  # 2 ranks per KV head


def test_the_mlp_must_split_too():
    with pytest.raises(TensorParallelConfigError, match="intermediate size 100"):
        plan(3, 0, heads=3, kv=3, inter=100)
