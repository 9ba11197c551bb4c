"""Fixtures of the quantized-checkpoint tests: the float models each format is written from."""

from __future__ import annotations

import pytest

from tests.engine.conftest import make_tiny_model


@pytest.fixture(scope="session")
def float_models(tmp_path_factory):
    """Random Llama-, Qwen2- and Qwen3-shaped float32 checkpoints saved by transformers."""
    root = tmp_path_factory.mktemp("float")
    return {"llama": make_tiny_model(root / "llama"),
            "qwen2": make_tiny_model(root / "qwen2", "qwen2", num_key_value_heads=4),
            "qwen3": make_tiny_model(root / "qwen3", "qwen3", perturb_norms=True, head_dim=32)}
