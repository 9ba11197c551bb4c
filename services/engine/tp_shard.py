"""Which slice of every weight one tensor-parallel rank holds (Megatron-style, as vLLM shards a Llama).

Attention is split by head: rank r holds query heads [r*Hq/N, (r+1)*Hq/N) and the KV heads they read,
so its Q/K/V rows (column-parallel) and its o_proj columns (row-parallel) are contiguous ranges. When
N exceeds the KV heads, each KV head is replicated on N/Hk consecutive ranks (vLLM's rule), so a rank
still holds whole heads. The MLP is split by intermediate row: gate/up column-parallel, down
row-parallel. Embedding and LM head are split by vocabulary row, padded to equal shards so the
sampled rows' logits can be gathered as equal pieces. A rank's KV cache holds only its KV heads, with
the same block ids as every other rank: the scheduler's bookkeeping does not change.

Plain arithmetic, no torch: `TensorParallelShard.plan` refuses a size the model cannot be split by,
naming the sizes that would fit.
"""

from __future__ import annotations

from dataclasses import dataclass


class TensorParallelConfigError(ValueError):
    """The model cannot be split into this many ranks."""


def _fits(size: int, num_heads: int, num_kv_heads: int, intermediate: int) -> str | None:
    """Why `size` does not fit (None when it does)."""
    if size < 1:
        return f"tensor_parallel_size must be >= 1, got {size}"
    if num_heads % size:
        return (f"tensor_parallel_size {size} does not divide the model's {num_heads} attention heads "
                f"(every rank must hold whole heads)")
    if size <= num_kv_heads and num_kv_heads % size:
        return f"tensor_parallel_size {size} does not divide the model's {num_kv_heads} KV heads"
    if size > num_kv_heads and size % num_kv_heads:
        return (f"tensor_parallel_size {size} is more than the model's {num_kv_heads} KV heads but not a "
                f"multiple of them (each KV head would be replicated on an uneven number of ranks)")
    if intermediate % size:
        return f"tensor_parallel_size {size} does not divide the MLP's intermediate size {intermediate}"
    return None


def valid_sizes(num_heads: int, num_kv_heads: int, intermediate: int) -> list[int]:
    """Every tensor-parallel size this model can be split by."""
    return [n for n in range(1, num_heads + 1) if _fits(n, num_heads, num_kv_heads, intermediate) is None]


@dataclass(frozen=True)
class TensorParallelShard:
    rank: int
    size: int
    head_dim: int
    num_heads: int  # this rank's query heads
    head_start: int
    num_kv_heads: int  # this rank's KV heads (1 when replicated)
    kv_head_start: int
    kv_replicas: int  # ranks holding each KV head (1: none replicated)
    intermediate: int  # this rank's MLP rows
    intermediate_start: int
    vocab_size: int  # the whole vocabulary
    vocab_start: int
    vocab_shard: int  # rows every rank's embedding shard has (the last one zero-padded)

    @classmethod
    def plan(cls, *, num_heads: int, num_kv_heads: int, head_dim: int, intermediate: int, vocab_size: int,
             size: int, rank: int) -> TensorParallelShard:
        why = _fits(size, num_heads, num_kv_heads, intermediate)
        if why is not None:
            fit = ", ".join(map(str, valid_sizes(num_heads, num_kv_heads, intermediate)))
            raise TensorParallelConfigError(f"{why}; sizes that fit this model: {fit}")
        if not 0 <= rank < size:
            raise TensorParallelConfigError(f"rank {rank} outside a group of {size}")
        heads = num_heads // size
        if size <= num_kv_heads:
            kv_heads, replicas = num_kv_heads // size, 1
            kv_start = rank * kv_heads
        else:
            kv_heads, replicas = 1, size // num_kv_heads
            kv_start = rank // replicas
        inter = intermediate // size
        vshard = -(-vocab_size // size)
        return cls(rank=rank, size=size, head_dim=head_dim, num_heads=heads, head_start=rank * heads,
                   num_kv_heads=kv_heads, kv_head_start=kv_start, kv_replicas=replicas, intermediate=inter,
                   intermediate_start=rank * inter, vocab_size=vocab_size, vocab_start=min(rank * vshard, vocab_size),
                   vocab_shard=vshard)

    @classmethod
    def for_config(cls, config, size: int, rank: int) -> TensorParallelShard:
        """From a DecoderSpec (or anything with its fields)."""
        return cls.plan(num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                        intermediate=config.intermediate_size, vocab_size=config.vocab_size, size=size, rank=rank)

    # Row ranges of the checkpoint's tensors this rank reads (start, end).
    @property
    def q_rows(self) -> tuple[int, int]:
        return self.head_start * self.head_dim, (self.head_start + self.num_heads) * self.head_dim

    @property
    def kv_rows(self) -> tuple[int, int]:
        return self.kv_head_start * self.head_dim, (self.kv_head_start + self.num_kv_heads) * self.head_dim

    @property
    def mlp_rows(self) -> tuple[int, int]:
        return self.intermediate_start, self.intermediate_start + self.intermediate

    @property
    def vocab_rows(self) -> tuple[int, int]:
        """The real vocabulary rows held (the shard is padded past them to `vocab_shard`)."""
        return self.vocab_start, min(self.vocab_start + self.vocab_shard, self.vocab_size)
