"""The CPU engine's C heap settings (services/engine/cpu_allocator.py), measured in fresh processes running
the bundled model: a step's large tensors fault their pages in again every step under glibc's defaults, and
almost never once the engine holds the thresholds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Two passes of 16 prompts of 256 tokens and 8 output tokens through the bundled model (prefill steps of
# 2,048 tokens: a 12 MiB gate_up output per layer); the page faults of the second pass.
_PROBE = """
import json, resource, sys
from services import LLM, SamplingParams
from services.engine.cpu_allocator import tune_cpu_heap
llm = LLM(max_num_seqs=64, max_num_batched_tokens=2048, kv_cache_memory="1G", device="cpu")
prompts = [[(97 * i + 13 * j) % 30000 + 100 for j in range(256)] for i in range(16)]
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
llm.generate(prompts, params, use_tqdm=False)
llm.core.pool.reset_cache()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
llm.generate(prompts, params, use_tqdm=False)
print(json.dumps({"tuned": tune_cpu_heap(), "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def _probe(env_extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    env.update(env_extra or {})
    env["PYTHONPATH"] = str(REPO)
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, cwd=REPO,
                         timeout=120, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _glibc() -> bool:
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c")).gnu_get_libc_version  # noqa: B018
    except (OSError, AttributeError, TypeError):
        return False
    return True


@pytest.mark.skipif(not _glibc(), reason="the thresholds are glibc's")
def test_held_thresholds_stop_the_per_step_page_faults():
    # An explicit MALLOC_ setting that changes nothing else keeps glibc's defaults: the baseline.
    plain, tuned = _probe({"MALLOC_ARENA_MAX": "8"}), _probe()
    assert plain["tuned"] is False and tuned["tuned"] is True
    # Measured on a 2-core Xeon: ~128,000 faults under the defaults, single digits with the heap kept.
    assert plain["faults"] > 10_000, plain
    assert tuned["faults"] < plain["faults"] / 20, (plain, tuned)


@pytest.mark.skipif(not _glibc(), reason="the thresholds are glibc's")
def test_an_explicit_malloc_setting_is_left_as_given():
    assert _probe({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"})["tuned"] is False
