"""Contiguous per-request KV reservations in one arena: the allocator of the papers' baselines.

Orca and FasterTransformer give each request one contiguous stretch of KV memory, sized when the request
is admitted: the maximum sequence length (Orca-Max, and FasterTransformer's static buffers), the prompt
plus the next power of two of the output length (Orca-Pow2), or exactly prompt plus output (Orca-Oracle,
told the length in advance). Here a reservation is a run of consecutive block ids of the same BlockPool
pagedserve uses, placed first-fit, so the engine runs it unchanged (a block table of consecutive ids)
and both kinds of waste are real: slots reserved but never written (internal fragmentation), and free
blocks scattered in runs too short for the next reservation (external fragmentation).

The "true output length" is `max_tokens`: the baselines' benchmark sets `ignore_eos`, so every request
writes exactly that many tokens, as the vLLM paper's oracle assumes. Sequences share nothing: no prefix
cache and no forks (parallel sampling is rejected at validation).
"""

from __future__ import annotations

import enum

from services.request.errors import InvalidRequestError
from services.request.sampling_params import SamplingParams
from services.scheduler.block_pool import BlockPool, KVBlock
from services.scheduler.sequence import Sequence


class Reservation(enum.Enum):
    MAX = "max"  # the model's maximum sequence length
    POW2 = "pow2"  # prompt + the next power of two of the output length
    ORACLE = "oracle"  # prompt + the output length, exactly


def reservation_tokens(policy: Reservation, num_prompt_tokens: int, max_tokens: int | None,
                       max_model_len: int) -> int:
    """KV slots one request reserves at admission."""
    if policy is Reservation.MAX or max_tokens is None:
        return max_model_len
    out = max_tokens if policy is Reservation.ORACLE else 1 << max(0, max_tokens - 1).bit_length()
    return min(max_model_len, num_prompt_tokens + out)


class ContiguousKVManager:
    """The KVCacheManager interface over contiguous reservations (first-fit in block-id order)."""

    supports_sharing = False

    def __init__(self, pool: BlockPool, block_size: int, policy: Reservation, max_model_len: int):
        if pool.enable_caching:
            raise ValueError("contiguous reservations share nothing: build the pool with enable_caching=False")
        self.pool = pool
        self.block_size = block_size
        self.policy = policy
        self.max_model_len = max_model_len
        self.watermark_blocks = 0
        self.runs: dict[str, list[KVBlock]] = {}  # seq_id -> its whole reservation
        self.tables: dict[str, list[KVBlock]] = {}  # seq_id -> the blocks written so far (a prefix of its run)
        self.block_ids: dict[str, list[int]] = {}
        self.group_block_ids: dict[str, list[list[int]]] = {}  # one KV group only (serving_system refuses more)
        self.prefix_queries = 0
        self.prefix_hits = 0

    # -- sizing -----------------------------------------------------------------------------
    def reservation_blocks(self, req: Sequence) -> int:
        tokens = reservation_tokens(self.policy, req.num_prompt_tokens, req.params.max_tokens, self.max_model_len)
        return -(-tokens // self.block_size)

    def check_request(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        if params.n > 1:
            raise InvalidRequestError("n", "contiguous-reservation baselines serve one sequence per request")
        tokens = reservation_tokens(self.policy, num_prompt_tokens, params.max_tokens, self.max_model_len)
        if -(-tokens // self.block_size) > self.pool.num_blocks:
            raise InvalidRequestError("max_tokens", f"a reservation of {tokens} tokens exceeds the KV arena of "
                                      f"{self.pool.num_blocks * self.block_size}")

    def free_runs(self) -> list[tuple[int, int]]:
        """(first block id, length) of every maximal run of free blocks, in block-id order."""
        runs, start = [], None
        for b in self.pool.blocks:
            if b.ref_cnt == 0:
                if start is None:
                    start = b.block_id
            elif start is not None:
                runs.append((start, b.block_id - start))
                start = None
        if start is not None:
            runs.append((start, self.pool.num_blocks - start))
        return runs

    def peak_blocks(self, num_tokens: int, chunk: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- admission and growth ---------------------------------------------------------------
    def find_cached_prefix(self, req: Sequence) -> list[KVBlock]:
        return []

    def allocate_slots(self, req: Sequence, num_new_tokens: int, cached: list[KVBlock] | None = None,
                       watermark: bool = False) -> bool:
        """Reserve the request's whole run on its first call; later calls only expose more of it."""
        run = self.runs.get(req.seq_id)
        if run is None:
            need = self.reservation_blocks(req)
            start = next((s for s, n in self.free_runs() if n >= need), None)
            if start is None:
                return False
            run = self.pool.blocks[start:start + need]
            for b in run:
                self.pool.take(b)
            self.runs[req.seq_id] = run
            self.tables[req.seq_id] = []
            self.block_ids[req.seq_id] = []
        total = -(-(req.num_computed_tokens + num_new_tokens) // self.block_size)
        if total > len(run):
            return False  # beyond its reservation: cannot happen while tokens stay within max_tokens
        table, ids = self.tables[req.seq_id], self.block_ids[req.seq_id]
        for b in run[len(table):total]:
            table.append(b)
            ids.append(b.block_id)
        return True

    def record_hit(self, req: Sequence, num_hit_tokens: int) -> None:
        self.prefix_queries += req.num_tokens

    def commit(self, req: Sequence) -> None:
        pass

    def fork(self, parent: Sequence, child: Sequence) -> None:
        # Unreachable by construction: validation refuses n > 1 and beam search for these systems.
        raise AssertionError("contiguous reservations are never shared (n > 1 is rejected at validation)")

    def free(self, req: Sequence) -> None:
        self.tables.pop(req.seq_id, None)
        self.block_ids.pop(req.seq_id, None)
        for b in self.runs.pop(req.seq_id, ()):
            self.pool.free(b)

    def take_copies(self) -> list[tuple[int, int]]:
        return []

    def usage(self) -> float:
        return self.pool.usage()
