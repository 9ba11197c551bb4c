import pytest

from services.model_files.model_source import resolve_model
from services.model_files.tokenizer import ModelTokenizer


@pytest.fixture(scope="session")
def tokenizer():
    """The real SmolLM2 tokenizer (detokenization and stop strings are tested with real text)."""
    return shared_tokenizer()


_TOKENIZER = None


def shared_tokenizer():
    global _TOKENIZER
    if _TOKENIZER is None:
        _TOKENIZER = ModelTokenizer(resolve_model(None))
    return _TOKENIZER
