"""`make images`: the router, scheduler and engine images (CUDA and CPU), built with whichever container
engine is here, from a registry's base images or, where none is reachable, from Debian's packages.

    python3 make/images.py build [--targets router,scheduler,engine-cpu,engine] [--base auto|registry|debian]
    python3 make/images.py engine            # which engine would build, or why none can

- The engine: podman (with runc: crun refuses cgroup v1 hosts) or docker with buildx (BuildKit: cache
  mounts and build secrets); with neither and root with apt-get, Debian's podman, buildah and runc are
  installed. Builds and containers use the host network only: no bridge, no private-range address.
- The base: `--base registry` builds the Dockerfiles as they are (python:3.11-slim-bookworm,
  nvidia/cuda). `--base debian` first builds a Debian bookworm base with debootstrap (python3, venv,
  CA certificates) and passes it as PYTHON_IMAGE and CUDA_IMAGE: the same Dockerfiles, other build args.
  `auto` takes the registry when Docker Hub answers and Debian otherwise.
- The build host's pip settings (index URLs, find-links) reach the build stages as build args, find-links
  directories served over HTTP on 127.0.0.1 while the build runs; its CA bundle as the build secret
  `pip-ca`. No image keeps any of them. A CPU torch wheel among the find-links (this project's
  machines carry torch 2.13.0+cpu) is the CPU images' torch.
- Each image's build time and size go to .images/report.json (and the table printed at the end); each
  image must answer `IMAGE --help`. .images/engine.json says how to run containers (tests/container_e2e).
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import zlib
from pathlib import Path

# make/ is this script's directory when run, not when a test loads it by path.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from image_storage import BUILD_LABEL, free_bytes, prune, room_to_build, step_images  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
STATE = REPO / ".images"
DEBIAN_BASE = "localhost/pagedserve-base/debian-python:bookworm"
DEBIAN_PACKAGES = ("python3", "python3-venv", "python-is-python3", "ca-certificates")
TARGETS = ("router", "scheduler", "engine-cpu", "engine")
DOCKERFILE = {"router": "router", "scheduler": "scheduler", "engine-cpu": "engine", "engine": "engine",
              "e2e-redis": None}


def log(text: str) -> None:
    print(f"images: {text}", flush=True)


def run(argv: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, text=True, **kw)


# -- the container engine ------------------------------------------------------------------------------
def _ulimits() -> list[str]:
    """The limits this process has, given explicitly: podman's defaults are higher, and raising a limit
    needs CAP_SYS_RESOURCE, which a sandboxed root may lack."""
    import resource

    flags = []
    # nproc: podman's own build default (32768) at most; on a sandboxed host even the host's own value
    # was refused while 32768 was taken.
    for name, res, cap in (("nofile", resource.RLIMIT_NOFILE, 1 << 20), ("nproc", resource.RLIMIT_NPROC, 32768)):
        soft, _ = resource.getrlimit(res)
        value = cap if soft == resource.RLIM_INFINITY else min(soft, cap)
        flags += ["--ulimit", f"{name}={value}:{value}"]
    return flags


def find_engine(install: bool = True) -> dict:
    """{'kind', 'cli' (argv prefix), 'build' (argv of a build), 'run_flags'} or {'error': why}."""
    if shutil.which("podman"):
        cli = ["podman"] + (["--runtime", "runc"] if shutil.which("runc") else [])
        if run(cli + ["info"], capture_output=True).returncode == 0:
            return {"kind": "podman", "cli": cli,
                    "build": cli + ["build", "--layers", "--force-rm", "--label", BUILD_LABEL] + _ulimits(),
                    "run_flags": _ulimits()}
    if shutil.which("docker") and run(["docker", "buildx", "version"], capture_output=True).returncode == 0 \
            and run(["docker", "info"], capture_output=True).returncode == 0:
        return {"kind": "docker", "cli": ["docker"],
                "build": ["docker", "buildx", "build", "--load", "--label", BUILD_LABEL],
                "run_flags": []}
    if install and os.geteuid() == 0 and shutil.which("apt-get"):
        log("no podman or docker with buildx here: installing Debian's podman, buildah and runc")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        done = run(["apt-get", "install", "-y", "-q", "podman", "buildah", "runc"], env=env, capture_output=True)
        if done.returncode:
            run(["apt-get", "update", "-q"], env=env, capture_output=True)
            done = run(["apt-get", "install", "-y", "-q", "podman", "buildah", "runc"], env=env, capture_output=True)
        if done.returncode == 0:
            return find_engine(install=False)
        return {"error": f"apt-get install podman failed: {done.stderr.strip().splitlines()[-1:]}"}
    return {"error": "no container engine (podman, or docker with buildx) and none can be installed here"}


def engine_works(engine: dict) -> str | None:
    """None when the engine can run a container on the host network here; else why not."""
    image = _any_local_image(engine)
    if image is None:
        return None  # nothing to try it on yet: the first build says
    done = run(engine["cli"] + ["run", "--rm", "--network", "host", *engine["run_flags"], "--entrypoint", "true",
                                image], capture_output=True, timeout=120)
    return None if done.returncode == 0 else done.stderr.strip()[-300:]


def _any_local_image(engine: dict) -> str | None:
    done = run(engine["cli"] + ["images", "--format", "{{.Repository}}:{{.Tag}}"], capture_output=True)
    names = [n for n in done.stdout.split() if "<none>" not in n]
    return names[0] if names else None


def image_exists(engine: dict, name: str) -> bool:
    return run(engine["cli"] + ["image", "inspect", name], capture_output=True).returncode == 0


# -- the base images -----------------------------------------------------------------------------------
def registry_reachable(timeout: float = 5.0) -> bool:
    try:
        urllib.request.urlopen("https://registry-1.docker.io/v2/", timeout=timeout)
    except urllib.error.HTTPError:
        return True  # 401: it answers
    except (OSError, urllib.error.URLError):
        return False
    return True


def _debian_mirror() -> str:
    for path in (Path("/etc/apt/sources.list.d/debian.sources"), Path("/etc/apt/sources.list")):
        if path.exists():
            found = re.search(r"^(?:URIs:|deb)\s+(?:\[[^]]*\]\s+)?(https?://\S+/debian)/?\s", path.read_text(), re.M)
            if found:
                return found.group(1)
    return "http://deb.debian.org/debian"


def build_debian_base(engine: dict) -> str:
    """A Debian bookworm root filesystem (python3, venv, CA certificates) from Debian's packages, imported
    as DEBIAN_BASE: what python:3.11-slim-bookworm gives, with no registry."""
    if image_exists(engine, DEBIAN_BASE):
        return DEBIAN_BASE
    if not shutil.which("debootstrap"):
        log("installing debootstrap")
        run(["apt-get", "install", "-y", "-q", "debootstrap"], check=True, capture_output=True,
            env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="debian-base-") as tmp:
        root = Path(tmp) / "root"
        log(f"debootstrap bookworm from {_debian_mirror()} (about a minute)")
        run(["debootstrap", "--variant=minbase", f"--include={','.join(DEBIAN_PACKAGES)}", "bookworm", str(root),
             _debian_mirror()], check=True, capture_output=True)
        # Package caches, manuals and translations (about 50 MB); each package's copyright file stays.
        for junk in ("var/cache/apt", "var/lib/apt/lists", "usr/share/man", "usr/share/info",
                     "usr/share/locale", "usr/share/doc"):
            for path in sorted((root / junk).rglob("*"), reverse=True):
                if path.is_file() and not (junk == "usr/share/doc" and path.name == "copyright"):
                    path.unlink()
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        path = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        run(engine["cli"] + ["import", "--change", f"ENV PATH={path}", "--change", "ENV LANG=C.UTF-8", "-",
                             DEBIAN_BASE], stdin=tar.stdout, check=True, capture_output=True)
        tar.wait()
    log(f"base {DEBIAN_BASE} built in {time.monotonic() - started:.0f}s")
    return DEBIAN_BASE


# -- the build host's pip settings ---------------------------------------------------------------------
def pip_settings() -> dict[str, str]:
    """The host's pip config and environment: index-url, extra-index-url, find-links, cert."""
    out: dict[str, str] = {}
    done = run([sys.executable, "-m", "pip", "config", "list"], capture_output=True)
    for line in done.stdout.splitlines():
        key, _, value = line.partition("=")
        out[key.split(".")[-1]] = value.strip().strip("'\"")
    for key, env in (("index-url", "PIP_INDEX_URL"), ("extra-index-url", "PIP_EXTRA_INDEX_URL"),
                     ("find-links", "PIP_FIND_LINKS"), ("cert", "PIP_CERT")):
        if os.environ.get(env):
            out[key] = os.environ[env]
    return out


# Ports for the find-links server: below Linux's ephemeral range (32768-60999), so no outgoing
# connection holds one.
_LINK_PORTS = (29100, 29900)


class LinkServer:
    """Local find-links directories, served over HTTP on 127.0.0.1 while a build runs (a build stage on
    the host network reaches them; nothing is copied into a build context or an image)."""

    def __init__(self, directories: list[Path]):
        self.urls: list[str] = []
        self._servers = []
        for directory in directories:
            handler = functools.partial(_QuietHandler, directory=str(directory))
            server = self._bind(directory, handler)
            threading.Thread(target=server.serve_forever, daemon=True).start()
            self._servers.append(server)
            self.urls.append(f"http://127.0.0.1:{server.server_address[1]}/")

    @staticmethod
    def _bind(directory: Path, handler) -> http.server.ThreadingHTTPServer:
        """The same port for the same directory, build after build: the URL reaches the build stages as
        the PIP_FIND_LINKS build arg, and podman keys every later RUN step's cache on the build args, so
        a new port each time rebuilt every stage after it (torch installed again, ~4 GB of new layers per
        build). A port already taken falls back to any free one (that build then misses the cache)."""
        port = _LINK_PORTS[0] + zlib.crc32(str(directory.resolve()).encode()) % (_LINK_PORTS[1] - _LINK_PORTS[0])
        try:
            return http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
        except OSError:
            return http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)

    def close(self) -> None:
        for server in self._servers:
            server.shutdown()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def cpu_torch_wheel(find_links: list[Path]) -> str | None:
    """The version of a local CPU torch wheel (e.g. '2.13.0+cpu'), if a find-links directory has one."""
    for directory in find_links:
        for wheel in sorted(directory.glob("torch-*+cpu-*.whl")):
            return wheel.name.split("-")[1]
    return None


# -- building ------------------------------------------------------------------------------------------
def _git(*args: str) -> str:
    done = run(["git", *args], cwd=REPO, capture_output=True)
    return done.stdout.strip() if done.returncode == 0 else ""


def version() -> str:
    return re.search(r'^version = "(.+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)


def build_args(target: str, base: str | None, pip: dict[str, str], links: LinkServer | None, cpu_torch: str | None,
               pytorch_reachable: bool) -> dict[str, str]:
    args = {"VERSION": version(), "REVISION": _git("rev-parse", "HEAD") or "unknown",
            "SOURCE": _git("config", "--get", "remote.origin.url") or f"file://{REPO}"}
    if base:
        args["PYTHON_IMAGE"] = args["CUDA_IMAGE"] = base
    index = pip.get("index-url", "")
    extra = " ".join(u for u in pip.get("extra-index-url", "").split() if u.startswith("http"))
    args.update(PIP_INDEX_URL=index, PIP_EXTRA_INDEX_URL=extra)
    cuda = target == "engine"
    if not cuda and links:
        args["PIP_FIND_LINKS"] = " ".join(links.urls)
    if not cuda and cpu_torch:
        # The host's CPU wheel, found through find-links next to the host's index.
        args.update(TORCH_VERSION=cpu_torch, TORCH_INDEX_URL=index or "https://pypi.org/simple",
                    TORCH_CPU_INDEX_URL=index or "https://pypi.org/simple")
    if cuda and not pytorch_reachable:
        # PyPI's Linux torch wheel is PyTorch's CUDA build (with nvidia-* runtime wheels and Triton).
        args["TORCH_INDEX_URL"] = index or "https://pypi.org/simple"
    if target.startswith("engine"):
        # Always given, the default too: buildah skips the stages a `FROM base-${ENGINE_DEVICE}` line
        # needs unless the argument is passed.
        args["ENGINE_DEVICE"] = "cpu" if target == "engine-cpu" else "cuda"
    return args


def tag_of(prefix: str, target: str, tag: str) -> str:
    return f"{prefix}/{target}:{tag}"


def build_one(engine: dict, target: str, image: str, args: dict[str, str], ca: str | None) -> float:
    dockerfile = (REPO / "docker" / f"{DOCKERFILE[target]}.Dockerfile" if DOCKERFILE.get(target)
                  else REPO / "tests" / "container_e2e" / f"{target.removeprefix('e2e-')}.Dockerfile")
    argv = [*engine["build"], "--network", "host", "-f", str(dockerfile), "-t", image]
    ignore = dockerfile.with_name(dockerfile.name + ".dockerignore")
    if engine["kind"] == "podman" and ignore.exists():
        argv += ["--ignorefile", str(ignore)]
    if ca:
        argv += ["--secret", f"id=pip-ca,src={ca}"]
    for key, value in args.items():
        argv += ["--build-arg", f"{key}={value}"]
    context = REPO if DOCKERFILE.get(target) else dockerfile.parent
    log(f"building {image} ({dockerfile.relative_to(REPO)})")
    started = time.monotonic()
    logfile = STATE / f"build-{target}.log"
    with open(logfile, "w") as out:
        done = run([*argv, str(context)], stdout=out, stderr=subprocess.STDOUT)
    seconds = time.monotonic() - started
    if done.returncode:
        tail = logfile.read_text().splitlines()[-25:]
        raise SystemExit(f"images: building {image} failed after {seconds:.0f}s (log {logfile}):\n" + "\n".join(tail))
    return seconds


def image_size(engine: dict, image: str) -> int:
    done = run(engine["cli"] + ["image", "inspect", "--format", "{{.Size}}", image], capture_output=True, check=True)
    return int(done.stdout.strip())


def help_works(engine: dict, image: str) -> bool:
    done = run(engine["cli"] + ["run", "--rm", "--network", "host", *engine["run_flags"], image, "--help"],
               capture_output=True, timeout=300)
    return done.returncode == 0 and "usage" in done.stdout.lower()


def cmd_build(ns) -> int:
    STATE.mkdir(exist_ok=True)
    engine = find_engine()
    if "error" in engine:
        if ns.if_possible:  # the one line `make test` prints about the images
            print(f"container-e2e: skipped, no image can be built here: {engine['error']}", flush=True)
            (STATE / "engine.json").write_text(json.dumps(engine))
            return 0
        raise SystemExit(f"images: {engine['error']}")
    log(f"engine: {' '.join(engine['cli'])}")
    base_mode = ns.base
    if base_mode == "auto":
        base_mode = "registry" if registry_reachable() else "debian"
        log(f"base images: {'from the registry' if base_mode == 'registry' else 'no registry answers: Debian base'}")
    started = time.monotonic()
    base = build_debian_base(engine) if base_mode == "debian" else None
    why = engine_works(engine)
    if why:
        engine = {"error": f"{engine['kind']} cannot run a container here: {why}"}
        (STATE / "engine.json").write_text(json.dumps(engine))
        if ns.if_possible:
            print(f"container-e2e: skipped, no container can run here: {engine['error']}", flush=True)
            return 0
        raise SystemExit(f"images: {engine['error']}")
    if not room_to_build(engine, STATE, ns.if_possible, log):
        return 0
    pip = pip_settings()
    link_dirs = [Path(u.removeprefix("file://")) for u in pip.get("find-links", "").split()
                 if not u.startswith("http") and Path(u.removeprefix("file://")).is_dir()]
    links = LinkServer(link_dirs) if link_dirs else None
    cpu_torch = cpu_torch_wheel(link_dirs)
    ca = pip.get("cert") or os.environ.get("SSL_CERT_FILE")
    ca = ca if ca and Path(ca).is_file() else None
    pytorch_reachable = _reachable("https://download.pytorch.org/whl/")
    report = {"engine": " ".join(engine["cli"]), "base": base or "registry", "cpu": _cpu_name(), "images": {}}
    try:
        for target in ns.targets.split(","):
            image = tag_of(ns.prefix, target, ns.tag)
            seconds = build_one(engine, target, image, build_args(target, base, pip, links, cpu_torch,
                                                                  pytorch_reachable), ca)
            size = image_size(engine, image)
            entry = {"image": image, "build_seconds": round(seconds), "size_mb": round(size / 1e6)}
            if DOCKERFILE.get(target):
                entry["help_works"] = help_works(engine, image)
                assert entry["help_works"], f"{image} --help failed"
            report["images"][target] = entry
            log(f"{image}: {entry['size_mb']} MB, built in {entry['build_seconds']}s")
    finally:
        if links:
            links.close()
    # This build's steps are the next build's layer cache; what earlier builds left is removed.
    keep = set().union(*(step_images((STATE / f"build-{t}.log").read_text()) for t in ns.targets.split(",")))
    removed, freed = prune(engine, keep)
    log(f"removed {removed} untagged images of earlier builds ({freed / 1e9:.1f} GB freed); "
        f"{free_bytes(engine) / 1e9:.1f} GB free")
    report["total_seconds"] = round(time.monotonic() - started)
    previous = json.loads((STATE / "report.json").read_text()) if (STATE / "report.json").exists() else {}
    previous.setdefault("images", {}).update(report["images"])
    report["images"] = previous["images"]
    (STATE / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (STATE / "engine.json").write_text(json.dumps(engine | {"prefix": ns.prefix, "tag": ns.tag}))
    for entry in report["images"].values():
        print(f"  {entry['image']:<40} {entry['size_mb']:>6} MB  {entry['build_seconds']:>5} s")
    log(f"done in {report['total_seconds']}s on {report['cpu']} ({report['base']} base); report in "
        f"{(STATE / 'report.json').relative_to(REPO)}")
    return 0


def _reachable(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=5)
    except urllib.error.HTTPError:
        return True
    except (OSError, urllib.error.URLError):
        return False
    return True


def _cpu_name() -> str:
    try:
        return next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build images")
    b.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, of {', '.join(TARGETS)}")
    b.add_argument("--base", choices=("auto", "registry", "debian"), default="auto")
    b.add_argument("--prefix", default="pagedserve")
    b.add_argument("--tag", default=version())
    b.add_argument("--if-possible", action="store_true", help="no container engine: say so and exit 0")
    sub.add_parser("engine", help="print the container engine a build would use")
    ns = parser.parse_args(argv)
    if ns.command == "engine":
        print(json.dumps(find_engine(install=False)))
        return 0
    return cmd_build(ns)


if __name__ == "__main__":
    sys.exit(main())
