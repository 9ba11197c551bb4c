"""`bench before-after`: an earlier revision's `bench throughput` against this checkout's, in one command."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_before_after_runs_both_revisions_and_reports_ratios(tiny_llama_dir, tmp_path):
    out = tmp_path / "ab.json"
    proc = subprocess.run(
        [sys.executable, "-m", "services.commands.cli", "bench", "before-after", "--before", "HEAD", "--runs", "1",
         "--json", str(out), "--", "--model", str(tiny_llama_dir), "--dtype", "float32", "--workload", "w1",
         "--scale", "0.05", "--max-num-seqs", "16"],
        cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "PAGEDSERVE_CPU_KERNELS": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["runs"]["before"][0]["tokens_per_s"] > 0 and report["runs"]["after"][0]["tokens_per_s"] > 0
    assert report["tokens_per_s_after_over_before"] > 0 and report["scheduler_ms_per_step_after_over_before"] > 0
    assert "after/before, medians of 1 alternating runs" in proc.stdout
    # The temporary worktree is gone again.
    listed = subprocess.run(["git", "worktree", "list"], cwd=REPO, capture_output=True, text=True).stdout
    assert "pagedserve-before-" not in listed
