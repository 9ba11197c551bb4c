"""The GPU check's dry run (`--device cpu --dry-run`) of its tensor-parallel section, with two gloo ranks,
and what it refuses. The single-GPU sections' dry run is the offline device command's
(tests/device_check/test_gpu_bundle.py), so the script cannot rot between the runs on a lent GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_dry_run_of_the_tensor_parallel_section(tmp_path):
    out = tmp_path / "gpu_check_tp.json"
    proc = subprocess.run([sys.executable, "-m", "services.device_check.run", "--device", "cpu", "--dry-run",
                           "--tensor-parallel-size", "2", "--sections", "engine", "--json", str(out)], cwd=REPO,
                          capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    items = {r["item"] for r in rows if r["section"] == "tiny-llama TP=2"}
    assert {"start-up of 2 ranks, eager", "decode batch 4, eager", "prefill 48 tokens"} <= items
    ranks = [r["data"] for r in rows if r["item"].startswith("rank ") and r["item"].endswith("weights + KV cache")]
    assert [r["rank"] for r in ranks] == [0, 1] and ranks[0]["weight_bytes"] == ranks[1]["weight_bytes"] > 0


def test_a_section_forced_to_skip_fails_the_dry_run(tmp_path):
    """A check that did not run is a check that failed: the dry run of the kernels, float16 skipped."""
    out, table = tmp_path / "check.json", tmp_path / "check.md"
    proc = subprocess.run([sys.executable, "-m", "services.device_check.run", "--device", "cpu", "--dry-run",
                           "--sections", "kernels", "--force-skip", "kernels float16", "--json", str(out),
                           "--table", str(table)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    verdict = "verdict: FAILED: kernels float16: not run (forced to skip (--force-skip))"
    assert verdict in proc.stdout and table.read_text().strip().splitlines()[-1] == verdict
    report = json.loads(out.read_text())
    assert report["finished"] == {"kernels float32": "passed", "kernels float16": "skipped"}
    assert report["failures"] == ["kernels float16: not run (forced to skip (--force-skip))"]


def test_triton_interpreter_is_refused_on_cuda():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "services.device_check.run"], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 2 and "TRITON_INTERPRET" in proc.stderr


def test_cpu_without_dry_run_is_refused():
    proc = subprocess.run([sys.executable, "-m", "services.device_check.run", "--device", "cpu"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--dry-run" in proc.stderr
