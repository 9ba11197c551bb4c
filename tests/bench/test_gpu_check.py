"""The GPU check's dry run (`--device cpu --dry-run`): every section of the device script runs on the CPU
at tiny shapes, through Triton's interpreter and a fake graph capture, so the script cannot rot between
the runs on a lent GPU; its tensor-parallel section too, with two gloo ranks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_dry_run_covers_every_section(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, "-m", "services.bench.gpu_check", "--device", "cpu", "--dry-run",
                           "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| section" in proc.stdout and "all checks passed" in proc.stdout
    report = json.loads(out.read_text())
    assert report["failures"] == []
    items = {(r["section"], r["item"]) for r in report["rows"]}
    kernels = [r for r in report["rows"] if r["section"] == "kernels"]
    assert {r["item"].split(" hq")[0] for r in kernels} >= {"decode", "decode, 7 splits", "prefill",
                                                             "write_kv (must be exact)"}
    assert all(r["data"]["ok"] for r in kernels)
    assert ("bandwidth", "SDPA on contiguous KV, same shape") in items
    assert any(s == "bandwidth" and i.startswith("paged decode B=") for s, i in items)
    for batch in (1, 2, 4):
        assert ("tiny-llama", f"decode batch {batch}, eager") in items
        assert ("tiny-llama", f"decode batch {batch}, fake graphs") in items
    assert ("tiny-llama", "prefill 48 tokens") in items and ("tiny-llama", "KV blocks allocated") in items
    assert ("tiny-llama", "fake graphs captured, sizes 1..4") in items


def test_dry_run_of_the_tensor_parallel_section(tmp_path):
    out = tmp_path / "gpu_check_tp.json"
    proc = subprocess.run([sys.executable, "-m", "services.bench.gpu_check", "--device", "cpu", "--dry-run",
                           "--tensor-parallel-size", "2", "--json", str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    items = {r["item"] for r in rows if r["section"] == "tiny-llama TP=2"}
    assert {"start-up of 2 ranks, eager", "decode batch 4, eager", "prefill 48 tokens"} <= items
    ranks = [r["data"] for r in rows if r["item"].startswith("rank ") and r["item"].endswith("weights + KV cache")]
    assert [r["rank"] for r in ranks] == [0, 1] and ranks[0]["weight_bytes"] == ranks[1]["weight_bytes"] > 0


def test_cpu_without_dry_run_is_refused():
    proc = subprocess.run([sys.executable, "-m", "services.bench.gpu_check", "--device", "cpu"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--dry-run" in proc.stderr
