"""bench gemm: the linears' shapes come from the model's config, every (linear, m) is timed on both
kernels where pagedserve's is built, and the report names the path the engine takes."""

from __future__ import annotations

import argparse
import json

from services.bench.offline import gemm_kernels
from tests.engine.conftest import make_tiny_model


def test_shapes_from_the_config(tmp_path):
    model = make_tiny_model(tmp_path / "m", "qwen3", head_dim=32)
    # 4 heads and 2 KV heads of 32 dims over hidden 64; intermediate 128.
    assert gemm_kernels.model_shapes(model) == {"qkv": (256, 64), "o": (64, 128), "gate_up": (256, 64),
                                                 "down": (64, 128)}


def test_the_report_times_every_linear_and_row_count(tmp_path, monkeypatch):
    import kernels.cpu as kc

    model = make_tiny_model(tmp_path / "m")
    real_copy_rate = gemm_kernels.copy_rate_gb_s
    monkeypatch.setattr(gemm_kernels, "copy_rate_gb_s", lambda: real_copy_rate(gib=1 / 64))  # 16 MiB, not 1 GiB
    real_read_rate = gemm_kernels.read_rate_gb_s
    monkeypatch.setattr(gemm_kernels, "read_rate_gb_s", lambda: real_read_rate(gib=1 / 64))
    out = tmp_path / "gemm.json"
    args = argparse.Namespace(model=str(model), rows=[1, 4], seed=0, json_path=str(out))
    assert gemm_kernels.run(args) == 0
    report = json.loads(out.read_text())
    assert [(r["linear"], r["m"]) for r in report["rows"]] == [(n, m) for n in ("qkv", "o", "gate_up", "down")
                                                              for m in (1, 4)]
    built = kc.load() is not None and kc.load().bf16_gemm_supported()
    for row in report["rows"]:
        assert row["torch_linear_gflops"] > 0
        assert (row["bf16_gemm_gflops"] is not None and row["bf16_gemm_gflops"] > 0) == built
        # A GEMM cannot beat the dot-product unit it runs on (small shapes sit far below it; 1.5: timer noise).
        assert (row["bf16_gemm_share_of_peak"] is not None) == built
        assert not built or 0 < row["bf16_gemm_share_of_peak"] < 1.5
    assert (report["bf16_dot_peak_gflops"] or 0) > 0 if built else report["bf16_dot_peak_gflops"] is None
    assert report["engine_linears"] in ("avx512", "onednn") and report["copy_gb_s"] > 0 and report["read_gb_s"] > 0


def test_the_copy_rate_is_measured():
    assert gemm_kernels.copy_rate_gb_s(gib=1 / 64) > 0
