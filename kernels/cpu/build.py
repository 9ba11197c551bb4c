"""Building the C++ CPU kernels: a build directory per distinct build, and a lock that cannot go stale.

torch's extension builder guards a build with a lock *file* that a killed compile leaves behind, after
which every later start waits on it forever, silently. And its default directory
(~/.cache/torch_extensions/<name>) is shared by every virtualenv, though each compiles with its own
include paths, so two virtualenvs rebuild each other's build. Here:

- the build directory lives under the pagedserve cache (cache_root) and is named by a digest of
  everything that changes the build: torch's version and include paths, the compiler, the flags, the
  sources and headers, and the checkout they sit in (torch's ninja file names their paths, so two
  checkouts of the same sources sharing one directory would rebuild each other's build at every start);
- pagedserve's own lock is an flock(2), which the kernel releases when its holder dies, so it is never
  stale; whoever holds it may delete torch's leftover lock file, since no one else can be compiling;
- a start that must compile says so, and a start that waits on another process's compile says whose,
  up to PAGEDSERVE_KERNEL_BUILD_TIMEOUT seconds (default 900), after which it gives up (the caller then
  runs on the PyTorch references);
- `-march=native` ties a build to the CPU it ran on, so the key also holds that CPU's instruction-set
  flags: an image compiled on one CPU and started on another compiles its own build (or, with no compiler,
  runs the references) rather than dying on an illegal instruction;
- a container image compiles at build time into PAGEDSERVE_KERNEL_PREBUILT (docker/engine.Dockerfile): a
  start whose key is found there imports that build directly, on a read-only root filesystem, with no
  compiler, lock or ninja run.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCES = [HERE / n for n in (
    "paged_decode.cpp", "decode_bf16.cpp", "amx_decode.cpp", "fused_ops.cpp", "bf16_gemm.cpp", "prefill_bf16.cpp",
    "quant_gemm.cpp", "amx_prefill.cpp")]
HEADERS = [HERE / "widen.h", HERE / "simd_exp.h", HERE / "amx_tiles.h"]
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
LDFLAGS = ["-fopenmp"]
DEFAULT_WAIT_TIMEOUT = 900.0
_POLL = 0.5


class BuildTimeout(RuntimeError):
    """Another process held the build lock for longer than the timeout."""


def cache_root() -> Path:
    # services.model_files.model_source.cache_root's rule; kernels may not import services (docs/architecture.md).
    env = os.environ.get("PAGEDSERVE_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pagedserve"


def _compiler_identity() -> str:
    cxx = os.environ.get("CXX", "c++")
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return cxx
    return f"{shutil.which(cxx) or cxx}: {out.splitlines()[0] if out else ''}"


# The CPU flags a -march=native build may use: a CPU that lacks one of the build machine's cannot run it.
_ISA_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
              "avx512_fp16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")


def isa_fingerprint() -> str:
    """The instruction-set flags of this CPU that a native build depends on ('' where unknown)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    have = set(line.partition(":")[2].split())
    return " ".join(f for f in _ISA_FLAGS if f in have)


def build_key(with_compiler: bool = True) -> str:
    """A digest of every input of the build; a different one means a different build directory.
    Without the compiler: the key a prebuilt build is found by (an image need not carry its compiler)."""
    import torch
    from torch.utils.cpp_extension import include_paths

    h = hashlib.sha256()
    for part in (torch.__version__, sys.version, _compiler_identity() if with_compiler else "",
                 " ".join(CFLAGS + LDFLAGS), str(HERE.resolve()), isa_fingerprint(),
                 *(os.path.realpath(p) for p in include_paths())):
        h.update(part.encode() + b"\0")
    for path in [*SOURCES, *HEADERS]:
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def module_name(key: str) -> str:
    return f"pagedserve_cpu_kernels_{key}"


def build_dir(key: str) -> Path:
    return cache_root() / "kernels" / f"cpu-{key}"


def _built(directory: Path, name: str) -> bool:
    return any(directory.glob(f"{name}*.so"))


class BuildLock:
    """An exclusive flock on `<build dir>.lock`; the file records the holder's pid for messages."""

    def __init__(self, path: Path):
        self.path = path
        self.fd: int | None = None

    def try_acquire(self) -> bool:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return True

    def holder(self) -> str:
        try:
            pid = self.path.read_text().strip()
        except OSError:
            return "another process"
        return f"process {pid}" if pid else "another process"

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def acquire(lock: BuildLock, timeout: float) -> None:
    """Take the lock, waiting (and saying on whom) up to `timeout` seconds; raises BuildTimeout."""
    if lock.try_acquire():
        return
    log.warning("waiting for %s, which is compiling the CPU kernels (lock %s; giving up after %.0fs)",
                lock.holder(), lock.path, timeout)
    deadline = time.monotonic() + timeout
    while not lock.try_acquire():
        if time.monotonic() >= deadline:
            raise BuildTimeout(f"{lock.holder()} held {lock.path} for more than {timeout:.0f}s")
        time.sleep(_POLL)


def prebuilt():
    """The build for this CPU, torch and these sources under PAGEDSERVE_KERNEL_PREBUILT, imported as it
    lies (None when there is none)."""
    root = os.environ.get("PAGEDSERVE_KERNEL_PREBUILT")
    if not root:
        return None
    key = build_key(with_compiler=False)
    found = sorted((Path(root) / f"cpu-{key}").glob(f"{module_name('')}*.so"))
    if not found:
        log.warning("no prebuilt CPU kernels for this CPU and torch under %s (key %s)", root, key)
        return None
    import importlib.util

    import torch  # noqa: F401  (the extension links against libtorch, loaded by importing torch)

    name = found[0].name.split(".")[0]  # the module name it was compiled under (its PyInit_ symbol)
    spec = importlib.util.spec_from_file_location(name, found[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build():
    """Build (or load the cached build of) the extension; raises on any failure, BuildTimeout included."""
    from torch.utils.cpp_extension import load as load_ext

    module = prebuilt()
    if module is not None:
        return module
    key = build_key()
    directory, name = build_dir(key), module_name(key)
    lock = BuildLock(directory.with_suffix(".lock"))
    acquire(lock, float(os.environ.get("PAGEDSERVE_KERNEL_BUILD_TIMEOUT", DEFAULT_WAIT_TIMEOUT)))
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # We hold the flock: nobody else compiles here, so torch's lock file can only be a dead
        # process's leftover, on which torch would wait forever.
        stale = directory / "lock"
        if stale.exists():
            log.warning("removing a stale build lock left by a killed compile: %s", stale)
            stale.unlink()
        if not _built(directory, name):
            log.warning("compiling the CPU kernels (about a minute, once per machine) in %s", directory)
        # Copies: torch appends to the flag lists it is given, which would change our key.
        return load_ext(name=name, sources=[str(p) for p in SOURCES], extra_include_paths=[str(HERE)],
                        extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS), build_directory=str(directory),
                        verbose=False)
    finally:
        lock.release()


def prebuild(dest: Path) -> Path:
    """Compile (or take the cached build) and copy the extension to dest/cpu-<key>/, where a start with
    PAGEDSERVE_KERNEL_PREBUILT=dest finds it: what docker/engine.Dockerfile's CPU variant runs at build time."""
    build()
    key = build_key()
    name = module_name(key)
    target = Path(dest) / f"cpu-{build_key(with_compiler=False)}"
    target.mkdir(parents=True, exist_ok=True)
    for so in build_dir(key).glob(f"{name}*.so"):
        shutil.copy2(so, target / so.name)
    assert any(target.glob(f"{name}*.so")), f"no {name}*.so in {build_dir(key)}"
    return target


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="compile the CPU kernels into a directory an image carries")
    parser.add_argument("--prebuild", type=Path, required=True, metavar="DIR")
    print(f"CPU kernels for [{isa_fingerprint()}] in {prebuild(parser.parse_args().prebuild)}")
