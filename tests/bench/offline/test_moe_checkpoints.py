"""`bench moe-checkpoints`: the MoE model and its dense twin have the same active MLP parameters per token,
and what it writes loads and serves (the shapes shrunk here; the real ones are 0.5 GB each)."""

from __future__ import annotations

import argparse

from services import LLM, SamplingParams
from services.bench.offline import moe_checkpoints


def test_the_dense_twin_has_the_moe_models_active_mlp_width():
    _, _, moe = moe_checkpoints.SHAPES["qwen3-moe-64x8"]
    _, _, dense = moe_checkpoints.SHAPES["qwen3-dense-active"]
    assert moe["num_experts_per_tok"] * moe["moe_intermediate_size"] == dense["intermediate_size"]
    attention = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim")
    assert all(moe[k] == dense[k] for k in attention)


def test_the_checkpoints_it_writes_serve(tmp_path, monkeypatch, capsys):
    small = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    shapes = {name: (c, m, {**shape, **small}) for name, (c, m, shape) in moe_checkpoints.SHAPES.items()}
    monkeypatch.setitem(shapes["qwen3-moe-64x8"][2], "num_experts", 8)
    monkeypatch.setattr(moe_checkpoints, "SHAPES", shapes)
    assert moe_checkpoints.run(argparse.Namespace(out=str(tmp_path))) == 0
    printed = capsys.readouterr().out
    for name in shapes:
        path = tmp_path / f"bench-{name}-v1"
        assert f"--model {path} --against vllm,transformers" in printed
        out = LLM(model=str(path), dtype="float32", num_kv_blocks=32).generate(
            [[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 4
    # Written once: a second run finds them complete and rewrites nothing.
    stamp = (tmp_path / "bench-qwen3-moe-64x8-v1" / "model.safetensors").stat().st_mtime_ns
    moe_checkpoints.run(argparse.Namespace(out=str(tmp_path)))
    assert (tmp_path / "bench-qwen3-moe-64x8-v1" / "model.safetensors").stat().st_mtime_ns == stamp
