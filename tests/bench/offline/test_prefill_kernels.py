"""`pagedserve bench prefill-attention`: every kernel this CPU runs is checked against SDPA and timed beside
it, and the row says which one the engine takes at that length."""

from __future__ import annotations

import json
import subprocess
import sys

from kernels.cpu import amx_in_use, load
from services.bench.offline.prefill_kernels import measure
from services.engine.cpu_prefill import AMX_PREFILL_MAX_TOKENS


def test_rows_time_each_kernel_beside_sdpa_and_name_the_engines_choice():
    rows = measure([17, AMX_PREFILL_MAX_TOKENS + 1], heads=4, kv_heads=2, head_dim=64, seconds=0.02)
    assert [r["tokens"] for r in rows] == [17, AMX_PREFILL_MAX_TOKENS + 1]
    mod = load()
    expected = {"sdpa"} | ({"amx_prefill"} if amx_in_use() and mod.amx_prefill_supported(64) else set()) | (
        {"prefill_bf16"} if mod.prefill_bf16_supported(64) else set())
    for r in rows:
        assert set(r["ms"]) == set(r["gflop_s"]) == expected
        assert all(v > 0 for v in r["ms"].values()) and set(r["speed_over_sdpa"]) == expected - {"sdpa"}
    if amx_in_use():
        assert rows[0]["engine_takes"] == "amx_prefill" and rows[1]["engine_takes"] == "sdpa"


def test_the_command_writes_its_json(tmp_path):
    out = tmp_path / "prefill.json"
    done = subprocess.run([sys.executable, "-m", "services.commands.cli", "bench", "prefill-attention",
                           "--lengths", "16", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["head_dim"] == 64 and data["rows"][0]["tokens"] == 16 and "pagedserve_paths" in data["machine"]
    assert "engine takes" in done.stdout
