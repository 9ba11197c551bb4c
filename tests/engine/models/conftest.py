"""Fixtures of the model-family tests: the tiny checkpoints and transformers' greedy tokens for them,
made once per session and shared by every test module here (tests/engine/models/test_families.py `tiny`)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def hf_cache() -> dict:
    return {}
