"""The rotary layer's frequencies and attention factors equal transformers' ROPE_INIT_FUNCTIONS bit for
bit for every RoPE type the families use (with partial rotation), and its rotation equals transformers'
apply_rotary_pos_emb; LongRoPE's factor set is chosen per engine and logged."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from services.engine.layers.rotary import RopeSpec, RotaryEmbedding, rope_inv_freq, rope_note
from services.engine.models.rope_config import rope_spec

HEAD_DIM = 32
CASES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 16.0},
    "yarn-mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128, "mscale": 0.7,
                    "mscale_all_dim": 0.5},
    "longrope": {"rope_type": "longrope", "short_factor": [1.0 + i / 8 for i in range(8)],
                 "long_factor": [2.0 + i for i in range(8)], "original_max_position_embeddings": 256},
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("max_model_len", [256, 1024])
def test_frequencies_equal_transformers(name, max_model_len):
    params = dict(CASES[name], rope_theta=10000.0, partial_rotary_factor=0.5 if name == "longrope" else 1.0)
    cfg = transformers.LlamaConfig(hidden_size=4 * HEAD_DIM, num_attention_heads=4, max_position_embeddings=1024,
                                   rope_parameters=dict(params))
    spec = rope_spec(cfg.rope_parameters, HEAD_DIM, cfg.max_position_embeddings)
    ours, factor = rope_inv_freq(spec, max_model_len)
    # transformers picks LongRoPE's set by the sequence length of the call: a call as long as what is served.
    theirs, their_factor = ROPE_INIT_FUNCTIONS[spec.rope_type](cfg, torch.device("cpu"), seq_len=max_model_len)
    assert torch.equal(ours, theirs.float()) and factor == their_factor


def test_rotation_equals_transformers_partial_rotary():
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    spec = RopeSpec(10000.0, HEAD_DIM // 2, max_position_embeddings=128)
    rope = RotaryEmbedding(spec, 128, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(7, 4, HEAD_DIM, generator=g), torch.randn(7, 2, HEAD_DIM, generator=g)
    pos = torch.tensor([0, 1, 5, 17, 60, 99, 127])
    ours_q, ours_k = rope(pos, q, k)
    cos = torch.cat([rope.cos[pos]] * 2, dim=-1)[None]
    sin = torch.cat([rope.sin[pos]] * 2, dim=-1)[None]
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    assert torch.allclose(ours_q, want_q[0].transpose(0, 1), atol=1e-6)
    assert torch.allclose(ours_k, want_k[0].transpose(0, 1), atol=1e-6)
    assert torch.equal(ours_q[..., HEAD_DIM // 2:], q[..., HEAD_DIM // 2:])  # the rest passes through


def test_longrope_factor_set_is_logged():
    spec = rope_spec(dict(CASES["longrope"], rope_theta=10000.0, partial_rotary_factor=0.5), HEAD_DIM, 1024)
    assert "long factors" in rope_note(spec, 1024) and "--max-model-len 256" in rope_note(spec, 1024)
    assert "short factors" in rope_note(spec, 256)
    assert rope_note(rope_spec({"rope_type": "default", "rope_theta": 1e4}, HEAD_DIM, 1024), 1024) is None
