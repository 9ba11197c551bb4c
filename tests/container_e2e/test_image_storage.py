"""make/image_storage.py against the real container engine: after a build, the untagged images that earlier
builds of this project left are removed, this build's layer cache stays, and nobody else's image is
touched. Tiny two-stage images on the Debian base that `make container-e2e` built first."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from tests.container_e2e import runtime

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "make"))
_spec = importlib.util.spec_from_file_location("image_storage", REPO / "make" / "image_storage.py")
storage = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(storage)

ENGINE = runtime.engine()
BASE = "localhost/pagedserve-base/debian-python:bookworm"
pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif("error" in ENGINE or ENGINE.get("kind") != "podman",
                                 reason=ENGINE.get("error", "pruning is podman's: docker buildx keeps its own cache"))]

DOCKERFILE = f"""FROM {BASE} AS stage
ARG CONTENT
RUN echo "$CONTENT" > /content
FROM {BASE}
COPY --from=stage /content /content
"""


def _build(tmp_path: Path, content: str, tag: str, labelled: bool = True) -> set[str]:
    (tmp_path / "Dockerfile").write_text(DOCKERFILE)
    argv = list(ENGINE["build"]) if labelled else [a for a in ENGINE["build"] if a not in ("--label",
                                                                                         storage.BUILD_LABEL)]
    done = subprocess.run([*argv, "--network", "host", "--build-arg", f"CONTENT={content}", "-t", tag,
                           str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:]
    return storage.step_images(done.stdout)


def _exists(image_id: str) -> bool:
    return subprocess.run(ENGINE["cli"] + ["image", "exists", image_id]).returncode == 0


def _untagged(image_id: str) -> bool:
    done = subprocess.run(ENGINE["cli"] + ["image", "inspect", "--format", "{{len .RepoTags}}", image_id],
                          capture_output=True, text=True)
    return done.returncode == 0 and done.stdout.strip() == "0"


def test_prune_removes_earlier_builds_keeps_this_ones_cache_and_others_images(tmp_path):
    if not _exists(BASE):
        pytest.skip(f"{BASE} is not built here")
    tag = "localhost/pagedserve-test/image-storage:1"
    foreign_tag = "localhost/pagedserve-test/not-ours:1"
    # The real build's images (its stages' cache among them) are not this test's to remove.
    before = storage._labelled_untagged(ENGINE)
    made: set[str] = set()
    try:
        first = _build(tmp_path, "first", tag)
        foreign = _build(tmp_path, "foreign", foreign_tag, labelled=False)
        subprocess.run(ENGINE["cli"] + ["untag", foreign_tag], capture_output=True)  # untagged, not removed
        second = _build(tmp_path, "second", tag)
        made = first | foreign | second
        only_first = {i for i in first - second if not any(s.startswith(i) or i.startswith(s) for s in second)}
        assert only_first and all(_exists(i) for i in only_first)

        removed, _ = storage.prune(ENGINE, keep=second | before)
        assert removed >= 1, (removed, only_first)  # removing a child may take its untagged parent with it
        assert not any(_exists(i) for i in only_first), "the first build's own images are gone"
        assert all(_exists(i) for i in second), "this build's steps (the next build's cache) stay"
        assert all(_exists(i) for i in foreign), "an image without the label is never removed"
        assert all(_exists(i) for i in before), "nor one the keep set names"

        again = subprocess.run([*ENGINE["build"], "--network", "host", "--build-arg", "CONTENT=second", "-t", tag,
                                str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               timeout=300)
        assert again.returncode == 0 and again.stdout.count("Using cache") >= 2, again.stdout[-2000:]
        assert storage.free_bytes(ENGINE) > 0
    finally:
        for image in (tag, foreign_tag):
            subprocess.run(ENGINE["cli"] + ["rmi", image], capture_output=True)
        for _ in range(3):  # children before parents; only the untagged ids this test made
            for image_id in made:
                if _untagged(image_id):
                    subprocess.run(ENGINE["cli"] + ["rmi", image_id], capture_output=True)


def test_step_images_reads_every_step_of_a_build_log():
    log = ("STEP 1/3: FROM base\nSTEP 2/3: RUN x\n--> Using cache 0123456789abcdef0123456789abcdef\n"
           "--> 0123456789a\nSTEP 3/3: COPY a b\n--> fedcba98765\nCOMMIT x\n--> fedcba98765\n"
           "--> not-an-id\n")
    assert storage.step_images(log) == {"0123456789abcdef0123456789abcdef", "0123456789a", "fedcba98765"}
