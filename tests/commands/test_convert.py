"""`pagedserve convert` on the bundled GGUF model: the tokenizer-only output is what the torch-free
router and scheduler read (no weights), the full output is a safetensors directory the engine loads,
converting again is a no-op, a directory converted from another source is replaced, and a Hugging Face
directory needs no conversion."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.commands.convert import convert
from services.model_files import model_source


def run_convert(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.commands.cli", "convert", *args], capture_output=True,
                           text=True,
                          timeout=600)


def test_tokenizer_only_then_full_conversion(tmp_path):
    gguf = model_source.default_gguf_path()
    tok = tmp_path / "tokenizer"
    result = run_convert("--model", str(gguf), "--output", str(tok), "--tokenizer-only")
    assert result.returncode == 0, result.stderr
    names = {p.name for p in tok.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= names
    assert not [n for n in names if n.endswith(".safetensors")], "the tokenizer output must hold no weights"
    marker = tok / model_source.CONVERTED_MARKER
    assert marker.read_text() == model_source.source_fingerprint(gguf, tokenizer_only=True)
    before = marker.stat().st_mtime_ns
    again = run_convert("--model", str(gguf), "--output", str(tok), "--tokenizer-only")
    assert again.returncode == 0 and "nothing to do" in again.stderr and marker.stat().st_mtime_ns == before

    # Another source's conversion in the directory: replaced, not trusted.
    marker.write_text("/elsewhere/other.gguf 1 1\n")
    (tok / "stale.txt").write_text("from the other model")
    convert(str(gguf), tok, tokenizer_only=True)
    assert not (tok / "stale.txt").exists()

    full = tmp_path / "model"
    result = run_convert("--model", str(gguf.parent), "--output", str(full))  # a directory holding the GGUF
    assert result.returncode == 0, result.stderr
    assert (full / "model.safetensors").stat().st_size > 100_000_000
    assert model_source.gguf_of(full) is None, "the output is a Hugging Face directory"


def test_a_hugging_face_directory_needs_no_conversion(tiny_llama_dir, tmp_path):
    with pytest.raises(SystemExit, match="already a Hugging Face directory"):
        convert(str(tiny_llama_dir), tmp_path / "out")
