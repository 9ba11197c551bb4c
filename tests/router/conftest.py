"""The router tests' tokenizer: the bundled model's, as a router loads it."""

from __future__ import annotations

import pytest

from services.model_files.model_source import resolve_model
from services.model_files.tokenizer import ModelTokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return ModelTokenizer(resolve_model(None))
