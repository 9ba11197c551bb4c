"""The device command, proven here: in a fresh clone, `make gpu-bundle PYTHON_VERSION=3.11` downloads the
wheels (pip's cache keeps it fast), then `make gpu-check-offline` with pip's index off runs the GPU
check's dry run with another interpreter that holds only torch, Triton and torch's own dependencies (as
the lent machine's python holds its own torch and Triton): no virtualenv of the project, no download.
Its table covers every section of the device run."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from services.device_check.workload import GPU_PLAN

REPO = Path(__file__).resolve().parents[2]


def _closure(names: list[str]) -> list[importlib.metadata.Distribution]:
    """The distributions `names` need, recursively (markers with extras or old Pythons skipped)."""
    seen, todo, out = set(), list(names), []
    while todo:
        name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        out.append(dist)
        for req in dist.requires or []:
            marker = req.partition(";")[2]
            if "extra" in marker or "python_version <" in marker:
                continue
            todo.append(re.match(r"[A-Za-z0-9_.-]+", req).group(0))
    return out


def torch_only_interpreter(root: Path) -> Path:
    """A virtualenv whose site-packages links only torch, Triton, their dependencies and pip."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    site = next((root / "lib").glob("python3*/site-packages"))
    for dist in _closure(["torch", "triton", "pip"]):
        base = Path(dist.locate_file(""))
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            src = base / top
            if src.exists() and not (site / top).exists() and top != "__pycache__":
                (site / top).symlink_to(src)
    return root / "bin" / "python"


@pytest.mark.timeout(900)
def test_offline_device_command_in_a_fresh_clone(tmp_path):
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "TRITON_INTERPRET", "OUT")}
    bundle = subprocess.run(["make", "-s", "-C", str(clone), "gpu-bundle", "PYTHON_VERSION=3.11",
                             f"PYTHON={sys.executable}"], env=env, capture_output=True, text=True, timeout=300)
    assert bundle.returncode == 0, bundle.stdout + bundle.stderr
    wheels = sorted(p.name.split("-")[0] for p in (clone / ".gpu-bundle").glob("*.whl"))
    assert wheels == ["h11", "httpcore2", "httpx2", "huggingface_hub", "idna", "numpy", "packaging", "pyyaml", "regex",
                      "safetensors", "tokenizers", "tqdm", "transformers", "truststore", "xxhash"]
    status = subprocess.run(["git", "-C", str(clone), "status", "--porcelain"], capture_output=True, text=True)
    assert status.stdout == "", "the bundle must land in an ignored folder"

    python = torch_only_interpreter(tmp_path / "torch-only")
    probe = subprocess.run([str(python), "-c", "import torch, triton\ntry:\n import numpy\nexcept ImportError:\n"
                            " print('no numpy')"], env=env, capture_output=True, text=True)
    assert probe.stdout.strip() == "no numpy", probe.stderr
    table, out_json = tmp_path / "table.md", tmp_path / "check.json"
    run = subprocess.run(["make", "-s", "-C", str(clone), "gpu-check-offline", f"PYTHON={python}",
                          f"GPU_CHECK_ARGS=--device cpu --dry-run --table {table} --json {out_json}"],
                         env={**env, "PIP_NO_INDEX": "1"}, capture_output=True, text=True, timeout=840)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert re.search(r"installing [^\n]*numpy-", run.stdout)
    assert "verdict: all 5 planned sections ran and passed" in run.stdout

    report = json.loads(out_json.read_text())
    assert report["failures"] == []
    rows = report["rows"]
    items = {(r["section"], r["item"]) for r in rows}
    for dtype in ("float32", "float16"):  # the GPU plan checks bfloat16 and float16 in the same code
        kernels = [r for r in rows if r["section"] == f"kernels {dtype}" and r["item"] != "section time"]
        assert {r["item"].split(" hq")[0] for r in kernels} >= {"decode", "decode, 7 splits", "prefill",
                                                                 "write_kv (must be exact)"}
        assert all(r["data"]["ok"] for r in kernels)
    assert GPU_PLAN.kernel_dtypes == ("bfloat16", "float16")
    assert ("bandwidth", "SDPA on contiguous KV, same shape") in items
    correct = {r["item"]: r for r in rows if r["section"] == "correct"}
    # Against the float32 reference of the same weights, every logits row within the bound.
    for item in ("greedy batch 4, fake graphs (captured size)", "greedy batch 4, eager", "whole prefill",
                 "prefill in chunks of 16", "prefix hit", "preempted and recomputed"):
        assert correct[item]["value"] == "yes" and correct[item]["data"]["rows"] > 0, correct[item]
        assert correct[item]["data"]["max_fraction"] <= 1e-3
    assert correct["seeded sampling (T=1, top-p 0.95) twice"]["value"] == "same"
    for batch in (1, 2, 4):
        assert ("tiny-llama", f"decode batch {batch}, eager") in items
        assert ("tiny-llama", f"decode batch {batch}, fake graphs") in items
    assert ("tiny-llama", "prefill 48 tokens") in items and ("tiny-llama", "KV blocks allocated") in items
    timed = {t["section"] for t in report["timings"]}
    assert timed == {"kernels float32", "kernels float16", "decode bandwidth", "engine correctness", "tiny-llama"}
    # The table file was written row by row: it holds every row of the run.
    lines = [line for line in table.read_text().splitlines() if line.startswith("| ")]
    assert len(lines) == len(rows) + 1  # and its header
    assert table.read_text().strip().splitlines()[-1] == "verdict: all 5 planned sections ran and passed"
