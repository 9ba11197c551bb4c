"""The CPU kernel build never hangs a start: a compile killed mid-way leaves nothing that blocks the
next one, and a wait on a live compile is bounded, says whose it is, and falls back to the references."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kernels.cpu import build

REPO = Path(__file__).resolve().parents[2]
LOAD = "from kernels.cpu import load; m = load(); print('LOADED' if m is not None else 'FALLBACK', flush=True)"
HOLD_LOCK = ("import sys, time; from pathlib import Path; from kernels.cpu.build import BuildLock; "
             "lock = BuildLock(Path(sys.argv[1])); assert lock.try_acquire(); print('HELD', flush=True); "
             "time.sleep(600)")


@pytest.fixture
def cache_with_build(tmp_path):
    """A private pagedserve cache holding a copy of this machine's finished build (no recompile)."""
    from kernels.cpu import load

    assert load() is not None, "the session's kernel build failed"
    key = build.build_key()
    src = build.build_dir(key)
    env = dict(os.environ, PAGEDSERVE_CACHE_DIR=str(tmp_path), PYTHONPATH=str(REPO))
    dst = tmp_path / "kernels" / src.name
    shutil.copytree(src, dst, symlinks=True, ignore=shutil.ignore_patterns("lock"))
    return env, dst


def _hold_lock(env: dict, lock_path: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(lock_path)], env=env, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "HELD"
    return proc


def _load(env: dict, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LOAD], env=env, capture_output=True, text=True, timeout=timeout)


def test_a_compile_killed_mid_way_does_not_stop_the_next_start(cache_with_build):
    env, directory = cache_with_build
    # What a process killed while compiling leaves: torch's lock file in the build directory, and our
    # flock, whose holder is killed with -9 (the kernel releases it).
    (directory / "lock").write_text("")
    holder = _hold_lock(env, directory.with_suffix(".lock"))
    holder.send_signal(signal.SIGKILL)
    holder.wait(10)
    t0 = time.monotonic()
    done = _load(env, timeout=120)
    assert "LOADED" in done.stdout, done.stderr
    assert "stale build lock" in done.stderr
    assert not (directory / "lock").exists()
    assert time.monotonic() - t0 < 60


def test_a_wait_on_a_live_compile_is_bounded_names_the_holder_and_falls_back(cache_with_build):
    env, directory = cache_with_build
    holder = _hold_lock(env, directory.with_suffix(".lock"))
    try:
        done = _load({**env, "PAGEDSERVE_KERNEL_BUILD_TIMEOUT": "1.5"}, timeout=60)
    finally:
        holder.kill()
        holder.wait(10)
    assert "FALLBACK" in done.stdout, done.stderr
    assert f"waiting for process {holder.pid}" in done.stderr
    assert "using the PyTorch references" in done.stderr


def test_the_build_directory_is_keyed_by_what_changes_the_build(monkeypatch, tmp_path):
    base = build.build_key()
    monkeypatch.setattr(build, "CFLAGS", [*build.CFLAGS, "-DPAGEDSERVE_TEST"])
    assert build.build_key() != base
    monkeypatch.setattr(build, "CFLAGS", build.CFLAGS[:-1])
    import torch.utils.cpp_extension as ext

    real = ext.include_paths
    monkeypatch.setattr(ext, "include_paths", lambda *a, **k: [str(tmp_path), *real(*a, **k)])
    assert build.build_key() != base
    monkeypatch.setattr(ext, "include_paths", real)
    # The same sources in another checkout: a build of its own, since torch's ninja file names their paths.
    other = tmp_path / "other-checkout"
    shutil.copytree(build.HERE, other)
    monkeypatch.setattr(build, "HERE", other)
    monkeypatch.setattr(build, "SOURCES", [other / p.name for p in build.SOURCES])
    monkeypatch.setattr(build, "HEADERS", [other / p.name for p in build.HEADERS])
    assert build.build_key() != base
    monkeypatch.setattr(build, "HERE", build.HERE.__class__(build.__file__).parent)
    monkeypatch.setattr(build, "SOURCES", [build.HERE / p.name for p in build.SOURCES])
    monkeypatch.setattr(build, "HEADERS", [build.HERE / p.name for p in build.HEADERS])
    assert build.build_key() == base
    # Another CPU (a native build made on an AMX Xeon started on an AVX2-only EPYC): a build of its own.
    monkeypatch.setattr(build, "isa_fingerprint", lambda: "avx avx2 fma")
    assert build.build_key() != base
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    assert build.build_dir(base).is_relative_to(tmp_path)


def test_kernel_builds_and_converted_models_share_one_cache_root(monkeypatch, tmp_path):
    from services.model_files.model_source import cache_root

    for env in ({"PAGEDSERVE_CACHE_DIR": str(tmp_path / "a")}, {"XDG_CACHE_HOME": str(tmp_path / "b")}, {}):
        monkeypatch.delenv("PAGEDSERVE_CACHE_DIR", raising=False)
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        assert build.cache_root() == cache_root()


def test_an_images_prebuilt_kernels_load_read_only_with_no_compiler(tmp_path):
    """What the CPU engine image does: kernels compiled at build time into a directory of the image, then
    imported at start from a read-only copy, with an empty cache and no working compiler."""
    from kernels.cpu import load

    assert load() is not None, "the session's kernel build failed"
    prebuilt = build.prebuild(tmp_path / "prebuilt")
    assert prebuilt.name == f"cpu-{build.build_key(with_compiler=False)}"
    assert [p.suffix for p in prebuilt.iterdir()] == [".so"]
    for path in (prebuilt, prebuilt.parent):
        path.chmod(0o555)
    cache = tmp_path / "cache"
    env = dict(os.environ, PAGEDSERVE_CACHE_DIR=str(cache), PAGEDSERVE_KERNEL_PREBUILT=str(prebuilt.parent),
               CXX="/bin/false", PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", LOAD + "; print(m.amx_available() in (True, False))"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["LOADED", "True"], done.stderr
    assert not cache.exists(), "a prebuilt start wrote to the cache"
    # A start on a CPU the image was not built for finds no build of its key there and compiles its own
    # (here: a compiler that fails, so the references run, as they do on any failed build).
    foreign = ("from kernels.cpu import build; build.isa_fingerprint = lambda: 'avx avx2 fma'; " + LOAD)
    done = subprocess.run([sys.executable, "-c", foreign], env=env, capture_output=True, text=True, timeout=300)
    assert done.stdout.split() == ["FALLBACK"], done.stdout + done.stderr
