"""The container engine's disk, for make/images.py: every image a build makes carries one label, the free
space is checked before a build starts, and what earlier builds left behind is removed after one succeeds.

Why: podman keeps every build's layers. A new commit changes the engine image's source layers, so each
fresh clone's `make container-e2e` added about 4 GB of untagged images that nothing used again; a CI
machine that builds every clone on one disk filled it (`no space left on device` while committing a
layer) after a few dozen runs.

- `BUILD_LABEL` is given to every build (`--label`); podman puts it on every stage's images, so the
  images this project made can be told from anyone else's.
- `step_images(log)`: the image of every step a build printed (`--> <id>`, cached or new). A successful
  build's steps are the layer cache the next build can reuse; they are kept.
- `prune(engine, keep)`: removes the untagged images with `BUILD_LABEL` that are not in `keep`, children
  before parents, never with force (a tagged image's parents stay; so does anything a container uses).
- `room_to_build(...)`: before a build, that `NEEDED_BYTES` are free (removing every earlier build's
  images if not); else the build is refused, or skipped with one line under `--if-possible`.
- `free_bytes(engine)`: the least free space among the engine's storage and its temporary directory
  (podman writes a layer's blob to /var/tmp before it commits it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

BUILD_LABEL = "dev.pagedserve.built-by=make-images"
# Free space a build of the CPU targets needs with nothing cached: the venv stage and the final stage's
# copy of it (~1.7 GB each), the model stage (~0.8 GB), layer blobs staged in the temporary directory
# while committing (the largest, ~1.7 GB), and the router, scheduler and Redis images; measured at
# ~6 GB, with headroom.
NEEDED_BYTES = 8 << 30


def step_images(log: str) -> set[str]:
    """Image ids (as printed: podman's 11 hex digits, or full) of every step in a podman build log."""
    ids = set()
    for line in log.splitlines():
        if line.startswith("--> "):
            word = line.split()[-1]
            if len(word) >= 10 and all(c in "0123456789abcdef" for c in word):
                ids.add(word)
    return ids


def _labelled_untagged(engine: dict) -> set[str]:
    """Full ids of the untagged images that carry BUILD_LABEL."""
    done = subprocess.run(engine["cli"] + ["images", "-a", "--no-trunc", "--filter", f"label={BUILD_LABEL}",
                                           "--format", "{{.ID}} {{.Repository}}:{{.Tag}}"],
                          capture_output=True, text=True)
    found = set()
    for line in done.stdout.splitlines():
        image_id, _, name = line.partition(" ")
        if "<none>" in name:
            found.add(image_id.removeprefix("sha256:"))
    return found


def prune(engine: dict, keep: set[str]) -> tuple[int, int]:
    """Remove this project's untagged images that are not in `keep` (ids, or the prefixes a build log prints).
    Returns (images removed, bytes freed on the disk)."""
    if engine.get("kind") != "podman":
        return 0, 0  # docker buildx keeps its cache in the builder, which `docker buildx prune` manages
    before = free_bytes(engine)
    candidates = {i for i in _labelled_untagged(engine) if not any(i.startswith(k) for k in keep)}
    removed = 0
    # One image at a time, children first: podman refuses a parent while a child exists, so passes repeat
    # until one removes nothing (what is left is a tagged image's parent or in use).
    while candidates:
        gone = set()
        for image_id in sorted(candidates):
            if subprocess.run(engine["cli"] + ["rmi", image_id], capture_output=True).returncode == 0:
                gone.add(image_id)
        if not gone:
            break
        removed += len(gone)
        candidates -= gone
    return removed, max(0, free_bytes(engine) - before)


def storage_paths(engine: dict) -> list[Path]:
    paths = [Path(os.environ.get("TMPDIR", "/var/tmp"))]
    if engine.get("kind") == "podman":
        done = subprocess.run(engine["cli"] + ["info", "--format", "{{.Store.GraphRoot}}"],
                              capture_output=True, text=True)
        if done.returncode == 0 and done.stdout.strip():
            paths.append(Path(done.stdout.strip()))
    return paths


def free_bytes(engine: dict) -> int:
    free = []
    for path in storage_paths(engine):
        while not path.exists() and path != path.parent:
            path = path.parent
        free.append(shutil.disk_usage(path).free)
    return min(free)


def room_to_build(engine: dict, state: Path, if_possible: bool, log: Callable[[str], None]) -> bool:
    """Is there the disk a build needs? If not, earlier builds' images (this build's layer cache among
    them) are removed first; if there is still too little, the build is refused (`if_possible`: skipped
    with one line saying so, and `state`/engine.json saying why, so no container test runs)."""
    free = free_bytes(engine)
    if free >= NEEDED_BYTES:
        return True
    removed, freed = prune(engine, keep=set())
    log(f"{free / 1e9:.1f} GB free, a build needs {NEEDED_BYTES / 1e9:.1f}: removed {removed} untagged images "
        f"of earlier builds ({freed / 1e9:.1f} GB)")
    free = free_bytes(engine)
    if free >= NEEDED_BYTES:
        return True
    why = (f"{free / 1e9:.1f} GB free for the container engine's storage and temporary files, a build of the "
           f"CPU images needs {NEEDED_BYTES / 1e9:.1f} GB")
    (state / "engine.json").write_text(json.dumps({"error": why}))
    if if_possible:
        print(f"container-e2e: skipped, no room to build the images: {why}", flush=True)
        return False
    raise SystemExit(f"images: {why}")
