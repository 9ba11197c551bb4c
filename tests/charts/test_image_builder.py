"""make/images.py's choices that need no container engine: the build args each image gets from the build
host's pip settings, the find-links server, the Debian mirror, the limits given to containers. The
builds themselves run in `make container-e2e` (tests/container_e2e)."""

from __future__ import annotations

import importlib.util
import re
import resource
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("make_images", REPO / "make" / "images.py")
images = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(images)


def test_cpu_images_take_the_hosts_cpu_torch_and_the_cuda_image_never_does(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    assert images.cpu_torch_wheel([wheels]) == "2.13.0+cpu"
    links = images.LinkServer([wheels])
    try:
        listing = urllib.request.urlopen(links.urls[0], timeout=10).read().decode()
        assert "torch-2.13.0+cpu" in listing and links.urls[0].startswith("http://127.0.0.1:")
        pip = {"index-url": "https://pypi.example/simple", "extra-index-url": "file:///opt/pypi/simple"}
        cpu = images.build_args("engine-cpu", "localhost/base:1", pip, links, "2.13.0+cpu", False)
        assert cpu["ENGINE_DEVICE"] == "cpu" and cpu["TORCH_VERSION"] == "2.13.0+cpu"
        assert cpu["PIP_FIND_LINKS"] == links.urls[0] and cpu["TORCH_CPU_INDEX_URL"] == pip["index-url"]
        assert cpu["PYTHON_IMAGE"] == cpu["CUDA_IMAGE"] == "localhost/base:1"
        assert cpu["PIP_EXTRA_INDEX_URL"] == "", "a file:// index of the host means nothing in a build"
        cuda = images.build_args("engine", None, pip, links, "2.13.0+cpu", False)
        # The CUDA engine: PyPI's torch (its Linux wheel is the CUDA build), never the host's CPU wheel.
        assert "PIP_FIND_LINKS" not in cuda and "TORCH_VERSION" not in cuda and cuda["ENGINE_DEVICE"] == "cuda"
        assert cuda["TORCH_INDEX_URL"] == pip["index-url"] and "PYTHON_IMAGE" not in cuda
        reachable = images.build_args("engine", None, pip, links, None, True)
        assert "TORCH_INDEX_URL" not in reachable, "PyTorch's own CUDA index (the Dockerfile's) when it answers"
        for target in ("router", "scheduler"):
            args = images.build_args(target, None, pip, links, "2.13.0+cpu", False)
            assert args["TORCH_VERSION"] == "2.13.0+cpu" and "ENGINE_DEVICE" not in args
            assert re.fullmatch(r"[0-9a-f]{40}|unknown", args["REVISION"]) and args["VERSION"] == images.version()
    finally:
        links.close()


def test_the_debian_mirror_is_the_hosts_and_limits_are_never_raised(tmp_path, monkeypatch):
    assert images._debian_mirror().startswith("http")
    flags = images._ulimits()
    values = dict(flag.split("=") for flag in flags[1::2])
    soft_nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert int(values["nofile"].split(":")[0]) <= (soft_nofile if soft_nofile != resource.RLIM_INFINITY else 1 << 20)
    assert int(values["nproc"].split(":")[0]) <= 32768


def test_each_dockerfile_takes_the_hosts_pip_settings_only_in_its_build_stages():
    for name in ("router", "scheduler", "engine"):
        text = (REPO / "docker" / f"{name}.Dockerfile").read_text()
        final = text[text.rindex("\nFROM "):]
        assert "pip-install" not in final and "PIP_INDEX_URL" not in final and "pip-ca" not in final
        assert "--mount=type=secret,id=pip-ca" in text
        for label in ("version", "revision", "source"):
            assert f"org.opencontainers.image.{label}=" in final
    script = (REPO / "docker" / "pip-install.sh").read_text()
    assert "/run/secrets/pip-ca" in script and "PIP_CERT" in script


def test_where_no_container_engine_can_run_one_line_says_so(tmp_path, monkeypatch, capsys):
    import argparse
    import json

    monkeypatch.setattr(images, "STATE", tmp_path)
    monkeypatch.setattr(images, "find_engine", lambda: {"error": "no container engine (podman, or docker with buildx)"})
    assert images.cmd_build(argparse.Namespace(if_possible=True)) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["container-e2e: skipped, no image can be built here: no container engine (podman, or docker "
                   "with buildx)"]
    assert "error" in json.loads((tmp_path / "engine.json").read_text())  # make container-e2e then runs nothing
