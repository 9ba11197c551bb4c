"""What a converted model directory says about itself: the name an engine serves it under, and that
every user can read it (an image converts as root and serves as uid 10001)."""

from __future__ import annotations

import stat
from pathlib import Path

from services.model_files import model_source as ms


def test_a_conversion_of_the_bundled_gguf_is_served_under_the_bundled_name(tmp_path):
    bundled = tmp_path / "default-model"
    bundled.mkdir()
    (bundled / ms.CONVERTED_MARKER).write_text(
        f"/opt/venv/lib/python3.11/site-packages/{ms.DEFAULT_MODEL_PACKAGE}/{ms.DEFAULT_MODEL_NAME}.Q4_1.gguf 98 1\n")
    assert ms.model_id_of(str(bundled), bundled) == ms.DEFAULT_MODEL_NAME
    other = tmp_path / "my-model"
    other.mkdir()
    (other / ms.CONVERTED_MARKER).write_text("/models/my-model.Q8_0.gguf 98 1\n")
    assert ms.model_id_of(str(other), other) == "my-model"
    assert ms.model_id_of(str(tmp_path), tmp_path) == tmp_path.name  # no marker: a Hugging Face directory
    assert ms.model_id_of(None, other) == ms.DEFAULT_MODEL_NAME


def test_a_written_directory_is_readable_by_every_user(tmp_path):
    out = tmp_path / "converted"
    with ms._written_whole(out) as tmp:
        (tmp / "model.safetensors").write_bytes(b"x")
        (tmp / "model.safetensors").chmod(0o600)  # what safetensors' writer leaves
        (tmp / "sub").mkdir(mode=0o700)
        (tmp / "sub" / "f").write_text("y")
    modes = {p.relative_to(out).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in [out, *out.rglob("*")]}
    assert modes == {".": 0o755, "model.safetensors": 0o644, "sub": 0o755, "sub/f": 0o644}, modes
    assert Path(out).is_dir()


def test_the_conversion_cache_is_keyed_by_the_file_not_its_path(tmp_path, monkeypatch):
    """Two checkouts (two virtualenvs, two paths to the same bundled file, written at different times) share
    one conversion; a file whose contents differ at its end or in a sampled piece gets its own."""
    import os

    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    data = os.urandom(5 << 20)

    def write(name: str, content: bytes, mtime: int):
        path = tmp_path / name / "m.Q4_1.gguf"
        path.parent.mkdir()
        path.write_bytes(content)
        os.utime(path, (mtime, mtime))
        return ms._converted_dir_for(path)

    first = write("venv-a", data, 1_700_000_000)
    assert write("venv-b", data, 1_700_003_000) == first  # pip writes a wheel's files at install time
    assert first.parent == tmp_path / "cache" / "models"
    tail = data[:-1] + bytes([data[-1] ^ 1])
    assert write("venv-c", tail, 1_700_000_000) != first
    middle = len(data) * 31 // 63 + 10  # inside one of the sampled pieces
    inside = data[:middle] + bytes([data[middle] ^ 1]) + data[middle + 1:]
    assert write("venv-d", inside, 1_700_000_000) != first
