"""`bench serve --lora-adapters`: one `pagedserve serve` with seeded adapters, each count's throughput and its
ratio to the base model, passes in order and reversed, and no run hitting another's cached prefixes."""

import json
import subprocess
import sys

from services.bench.serve.lora import remap
from services.bench.serve.workloads import ServeRequest


def test_remapped_prompts_keep_lengths_and_sharing_and_change_every_token_set():
    reqs = [ServeRequest(0, 4, [5, 6, 7, 8]), ServeRequest(1, 4, [5, 6, 9])]
    a, b = remap(reqs, 1000, 1), remap(reqs, 1000, 2)
    assert [len(r.prompt) for r in a] == [4, 3] and a[0].prompt[:2] == a[1].prompt[:2]  # shared prefix kept
    assert a[0].prompt != b[0].prompt and reqs[0].prompt == [5, 6, 7, 8]  # a fresh copy per seed


def test_bench_serve_with_adapters_in_the_mix(tiny_llama_dir, tmp_path):
    out = tmp_path / "lora.json"
    done = subprocess.run([sys.executable, "-m", "services.commands.cli", "bench", "serve", "--lora-adapters", "0,2",
                           "--model", str(tiny_llama_dir), "--dtype", "float32", "--kv-cache-memory", "64M",
                           "--max-model-len", "512", "--num-requests", "6", "--input-len", "8-32",
                           "--output-len", "4-8", "--rates", "inf", "--warmup", "1", "--log-dir", str(tmp_path),
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert [(r["adapters"], r["pass"]) for r in report["runs"]] == [(0, 1), (2, 1), (2, 2), (0, 2)]
    assert all(r["completed"] == 6 and r["failed"] == 0 for r in report["runs"])
    rows = {r["adapters"]: r for r in report["summary"]}
    assert rows[0]["ratio_to_base"] == 1.0 and rows[2]["ratio_to_base"] > 0
    assert "LoRA cost online" in done.stdout


def test_adapter_counts_are_checked():
    done = subprocess.run([sys.executable, "-m", "services.commands.cli", "bench", "serve", "--lora-adapters", "x",
                           "--systems", "serve"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--lora-adapters" in done.stderr
