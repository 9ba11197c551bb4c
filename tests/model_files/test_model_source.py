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
    """Two checkouts (two virtualenvs, two paths to the same bundled file) share one conversion; a file
    with other contents, or replaced at the same path, gets its own."""
    import os
    import shutil

    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    data = os.urandom(3 << 20)
    first = tmp_path / "venv-a" / "m.Q4_1.gguf"
    second = tmp_path / "venv-b" / "m.Q4_1.gguf"
    for path in (first, second):
        path.parent.mkdir()
        path.write_bytes(data)
    shutil.copystat(first, second)  # pip gives every install of a wheel the same mtimes
    assert ms._converted_dir_for(first) == ms._converted_dir_for(second)
    assert ms._converted_dir_for(first).parent == tmp_path / "cache" / "models"

    tail_changed = tmp_path / "venv-c" / "m.Q4_1.gguf"
    tail_changed.parent.mkdir()
    tail_changed.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    shutil.copystat(first, tail_changed)
    assert ms._converted_dir_for(tail_changed) != ms._converted_dir_for(first)

    stat = first.stat()
    os.utime(second, (stat.st_atime, stat.st_mtime + 5))  # replaced in place: a new mtime
    assert ms._converted_dir_for(second) != ms._converted_dir_for(first)
