"""The chart's images, made locally: one virtualenv per image, installed the way its Dockerfile installs
the package, plus the files the Dockerfile bakes in and the ENV it sets.

The install line is read from the Dockerfile itself (the build stage whose /opt/venv the final stage
copies): the same extras, torch only where the Dockerfile installs it, no test dependencies. The
dependencies are installed once per (pyproject.toml, install line, Python) and cached under
.venv-images/; the package itself is rebuilt as a wheel from the working tree on every run and put in
with --no-deps, so the processes run today's code from site-packages, not from the source tree. The
bundled model at /opt/pagedserve/default-model is what the Dockerfile's model stage writes with
`pagedserve convert` (the tokenizer only for router and scheduler), made here by the same command.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from services.commands.redis_binary import find_redis_server

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
CACHE = REPO / ".venv-images"
IMAGE_VENV = "/opt/venv"
BUNDLED_MODEL = "/opt/pagedserve/default-model"
SERVICES = ("router", "scheduler", "engine")


@dataclass(frozen=True)
class InstallSpec:
    """What one Dockerfile installs into the image's /opt/venv."""

    extras: tuple[str, ...]
    torch_version: str | None  # None: the image carries no torch
    model_convert_args: tuple[str, ...]  # `pagedserve convert` flags of its model stage
    env: tuple[tuple[str, str], ...]  # ENV of the final stage, in order


def _stages(text: str) -> dict[str, str]:
    """Dockerfile stages by name ('final' for the last), continuation lines joined."""
    joined = re.sub(r"\\\n\s*", " ", text)
    parts = re.split(r"^FROM\s+", joined, flags=re.M)[1:]
    stages = {}
    for i, part in enumerate(parts):
        header, _, body = part.partition("\n")
        name = header.split(" AS ")[1].strip() if " AS " in header else f"stage{i}"
        stages[name] = body
        stages[f"header:{name}"] = header
    stages["final"] = parts[-1].partition("\n")[2]
    return stages


def install_spec(service: str) -> InstallSpec:
    text = (DOCKER / f"{service}.Dockerfile").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))
    stages = _stages(text)
    final = stages["final"]
    source = re.search(rf"^COPY --from=(\w+) {IMAGE_VENV} {IMAGE_VENV}$", final, re.M).group(1)
    # The venv's stage and the stages it is built FROM (the engine trims its venv in a stage of its own).
    build, parent = "", source
    while parent in stages:
        build = stages[parent] + "\n" + build
        parent = re.match(r"(\S+)", stages[f"header:{parent}"]).group(1)
    # pip-install is docker/pip-install.sh (pip install with the build host's settings); the engine's CUDA
    # variant installs a second extra (triton) in a step of its own.
    installs = re.findall(r'pip(?:-install| install) (?:"/src\[([\w,]*)\]"|/src)(?:\s|;|$)', build)
    assert installs, f"{service}.Dockerfile: no `pip-install /src[...]` in stage {source}"
    extras = tuple(e for group in installs for e in group.split(",") if e)
    torch = (args["TORCH_VERSION"] if re.search(r'pip(?:-install| install) [^\n]*"torch==\$\{TORCH_VERSION\}"', build)
             else None)
    model_stage = re.search(rf"^COPY --from=(\w+) \S+ {BUNDLED_MODEL}$", final, re.M).group(1)
    convert = re.search(r"pagedserve convert ([^\n]*)", stages[model_stage])
    if convert:
        flags = tuple(a for a in convert.group(1).split() if a.startswith("--") and not a.startswith("--output"))
    else:  # the engine's model stage converts with convert_gguf (a full conversion)
        assert "convert_gguf(" in stages[model_stage], f"{service}.Dockerfile: how is the model made?"
        flags = ()
    env_lines = " ".join(re.findall(r"^ENV (.*)$", final, re.M))
    env = tuple(re.findall(r"(\w+)=(\S+)", env_lines))
    return InstallSpec(extras, torch, flags, env)


@dataclass
class Image:
    """A local stand-in for one container image: its venv, its baked-in files, its ENV."""

    name: str
    venv: Path | None
    paths: dict[str, Path] = field(default_factory=dict)  # image path -> host path
    env: list[tuple[str, str]] = field(default_factory=list)
    path_dirs: list[Path] = field(default_factory=list)  # PATH entries of the image


def _pip(python: Path, *args: str, timeout: float = 1800) -> None:
    done = subprocess.run([str(python), "-m", "pip", "-q", "--disable-pip-version-check", *args],
                          capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"pip {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")


def _venv_key(spec: InstallSpec) -> str:
    text = (REPO / "pyproject.toml").read_text() + repr((spec.extras, spec.torch_version)) + sys.version
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def dependency_venv(service: str, spec: InstallSpec) -> Path:
    """The image's venv with its dependencies installed (built once per key, reused after)."""
    venv = CACHE / f"{service}-{_venv_key(spec)}"
    if (venv / ".complete").exists():
        return venv
    if venv.exists():
        shutil.rmtree(venv)
    started = time.monotonic()
    print(f"chart-e2e: building the {service} image's virtualenv in {venv} (once per pyproject.toml)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    if spec.torch_version:
        _pip(python, "install", f"torch=={spec.torch_version}")
    target = f"{REPO}[{','.join(spec.extras)}]" if spec.extras else str(REPO)
    _pip(python, "install", target)  # the dependencies stay; the package is replaced on every run
    for old in CACHE.glob(f"{service}-*"):
        if old != venv:
            shutil.rmtree(old, ignore_errors=True)
    (venv / ".complete").write_text(f"{target}\n")
    print(f"chart-e2e: {service} virtualenv ready in {time.monotonic() - started:.0f}s", flush=True)
    return venv


def build_wheel(out: Path) -> Path:
    """This working tree as a wheel (what `pip install /src` builds in the image)."""
    _pip(Path(sys.executable), "wheel", "--no-deps", "-w", str(out), str(REPO), timeout=600)
    (wheel,) = out.glob("pagedserve-*.whl")
    return wheel


def bundled_model(tokenizer_only: bool) -> Path:
    """/opt/pagedserve/default-model of the images: what their model stage writes with `pagedserve convert`."""
    out = CACHE / "models" / ("default-model-tokenizer" if tokenizer_only else "default-model")
    args = [sys.executable, "-m", "services.commands.cli", "convert", "--output", str(out), "--log-level", "warning"]
    subprocess.run(args + (["--tokenizer-only"] if tokenizer_only else []), check=True, timeout=1800)
    return out


def build_images(work: Path) -> dict[str, Image]:
    """Every image the chart runs: router, scheduler, engine (from their Dockerfiles) and Redis."""
    wheel = build_wheel(work / "wheel")
    images: dict[str, Image] = {}
    for service in SERVICES:
        spec = install_spec(service)
        venv = dependency_venv(service, spec)
        _pip(venv / "bin" / "python", "install", "--no-deps", "--force-reinstall", str(wheel))
        model = bundled_model(tokenizer_only="--tokenizer-only" in spec.model_convert_args)
        images[service] = Image(service, venv, {IMAGE_VENV: venv, BUNDLED_MODEL: model}, list(spec.env),
                                [venv / "bin"])
    redis = find_redis_server()
    assert redis, "no redis-server: `make install` provides one"
    images["redis"] = Image("redis", None, {}, [], [Path(redis).parent])
    images["valkey"] = images["redis"]
    return images
