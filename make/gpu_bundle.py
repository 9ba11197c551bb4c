"""The GPU check's offline bundle (make/gpu.mk: `make gpu-bundle`, `make gpu-check-offline`).

`download`: here, with network: every wheel the check imports beyond torch and Triton, for one Python
version on x86-64 Linux (binary wheels only, no dependencies resolved: the list is complete), into an
ignored folder of the repository that the device tool carries (`carry: [".gpu-bundle"]`).
`install`: there, with no network: the wheels the interpreter lacks, into a temporary folder
(`pip install --no-index --no-deps --target`); a package the image already has is left as it is.

Standard library only: it runs before anything else is installed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys
from pathlib import Path

# What services.device_check.run imports beyond torch and Triton (and torch's own dependencies), found by
# running its dry run with an interpreter that holds only those (tests/device_check/test_gpu_bundle.py does).
# The engine reads every config.json through transformers' own config classes (services/engine/models), so
# transformers and what it imports at start come along (about 37 MiB in all). numpy below 2.4: the device's
# Triton 3.6 interpreter (the GPU check's --dry-run) turns one-element arrays into loop bounds with int(),
# which numpy 2.4 refuses ("only 0-dimensional arrays can be converted"; Triton 3.9 squeezes first); found by
# running the offline dry run with Python 3.12, torch 2.11 and Triton 3.6, the device's stack.
CHECK_REQUIREMENTS = ("numpy>=1.26,<2.4", "xxhash>=3.4", "safetensors>=0.4", "transformers>=5,<5.25", "huggingface-hub",
                      "tokenizers", "regex", "pyyaml", "packaging", "tqdm", "httpx2", "httpcore2", "h11", "idna",
                      "truststore")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
LIMIT_BYTES = 56 << 20  # the device tool carries 64 MiB with the working tree (about 3 MiB)


def download(dest: Path, python_version: str) -> int:
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):  # one version of each: two would stop the install there
        old.unlink()
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
           "--python-version", python_version, "--implementation", "cp", "--dest", str(dest)]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    rc = subprocess.call(cmd + list(CHECK_REQUIREMENTS))
    if rc:
        return rc
    wheels = sorted(dest.glob("*.whl"))
    total = sum(w.stat().st_size for w in wheels)
    for w in wheels:
        print(f"  {w.name}  {w.stat().st_size / 2**20:.1f} MiB")
    print(f"{len(wheels)} wheels for Python {python_version}, {total / 2**20:.1f} MiB in {dest}")
    if total > LIMIT_BYTES:
        print(f"over {LIMIT_BYTES >> 20} MiB: the device tool would not carry them with the tree", file=sys.stderr)
        return 1
    return 0


def _dist_name(wheel: Path) -> str:
    return wheel.name.split("-")[0]


def install(wheels_dir: Path, target: Path) -> int:
    wheels = sorted(wheels_dir.glob("*.whl"))
    if not wheels:
        print(f"no wheels in {wheels_dir}: run `make gpu-bundle` where there is network, and carry the folder",
              file=sys.stderr)
        return 1
    missing = []
    for w in wheels:
        try:
            have = importlib.metadata.version(_dist_name(w))
        except importlib.metadata.PackageNotFoundError:
            missing.append(w)
        else:
            print(f"  {_dist_name(w)}: {have} already here (bundle's {w.name.split('-')[1]} not installed)")
    if missing:
        print("  installing " + ", ".join(w.name for w in missing) + f" into {target}")
        rc = subprocess.call([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                              "--no-compile", "--no-cache-dir", "--disable-pip-version-check", "--target",
                              str(target), *map(str, missing)])
        if rc:
            return rc
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("download")
    d.add_argument("--dest", type=Path, required=True)
    d.add_argument("--python-version", default="3.12")
    i = sub.add_parser("install")
    i.add_argument("--wheels", type=Path, required=True)
    i.add_argument("--target", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.command == "download":
        return download(args.dest, args.python_version)
    return install(args.wheels, args.target)


if __name__ == "__main__":
    sys.exit(main())
