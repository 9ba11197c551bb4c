"""Block hashes: SHA-256 chains that router and scheduler compute alike, and cache salts that keep
tenants' blocks apart."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from array import array

from services.contracts.block_hash import adapter_seed, hash_block, hash_blocks, model_hash_seed, salted_seed
from services.request.sampling_params import SamplingParams
from services.scheduler.core import SchedulerCore
from tests.scheduler.conftest import shared_tokenizer
from tests.scheduler.shadow_executor import ShadowExecutor


def test_chain_is_sha256_of_parent_and_tokens():
    seed = model_hash_seed("m", 16)
    assert seed == int.from_bytes(hashlib.sha256(b"pagedserve:m:16").digest(), "big")
    tokens = list(range(32))
    want = int.from_bytes(hashlib.sha256(seed.to_bytes(32, "big") + array("I", tokens[:16]).tobytes()).digest(),
                          "big")
    hashes = hash_blocks(tokens + [1, 2, 3], 16, seed)
    assert len(hashes) == 2 and hashes[0] == want == hash_block(seed, tokens[:16])
    assert hashes[1] == hash_block(hashes[0], tokens[16:])
    assert hash_blocks(tokens, 16, seed, start_block=1, parent_hash=hashes[0]) == hashes[1:]
    assert hash_blocks(tokens, 16, seed, num_blocks=1) == hashes[:1]


def test_hashes_are_the_same_in_another_process():
    code = ("from services.contracts.block_hash import *; "
            "print(hash_blocks(list(range(40)), 8, salted_seed(model_hash_seed('m', 8), 't'))[-1])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert int(out) == hash_blocks(list(range(40)), 8, salted_seed(model_hash_seed("m", 8), "t"))[-1]


def test_salts_never_share_a_block():
    seed = model_hash_seed("m", 4)
    assert salted_seed(seed, None) == salted_seed(seed, "") == seed
    a, b = salted_seed(seed, "tenant-a"), salted_seed(seed, "tenant-b")
    assert len({seed, a, b}) == 3
    assert not set(hash_blocks(list(range(64)), 4, a)) & set(hash_blocks(list(range(64)), 4, b))


def test_the_scheduler_reuses_blocks_only_within_one_salt():
    ex = ShadowExecutor(num_blocks=64, block_size=4)
    core = SchedulerCore(ex, shared_tokenizer(), max_num_seqs=4)
    ex.lookup = lambda sid: next(r.token_ids for r in core.scheduler.running if r.seq_id == sid)
    prompt = [11 + i for i in range(21)]

    def cached(rid: str, salt: str | None) -> int:
        core.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=2, cache_salt=salt))
        while core.has_unfinished():
            for out in core.step():
                if out.finished:
                    got = out.num_cached_tokens
        return got

    assert cached("a1", "a") == 0
    assert cached("a2", "a") == 20  # five full blocks of the same tenant
    assert cached("b1", "b") == 0
    assert cached("none", None) == 0
    assert cached("none2", None) == 20


def test_adapter_seed_roots_a_chain_per_adapter_content():
    seed = model_hash_seed("m", 16)
    a, b = "a" * 64, "b" * 64
    assert adapter_seed(seed, a) == adapter_seed(seed, a)
    assert len({seed, adapter_seed(seed, a), adapter_seed(seed, b), adapter_seed(model_hash_seed("m", 32), a)}) == 4
    # The cache salt applies on top of the adapter's root, and neither can stand in for the other.
    assert salted_seed(adapter_seed(seed, a), "k") not in {adapter_seed(seed, a), salted_seed(seed, "k")}
