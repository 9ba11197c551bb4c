"""transformers' own model classes for architectures without a family module (not yet: refused)."""

from __future__ import annotations

from services.engine.models.spec import UnsupportedModelError


def transformers_choice(raw: dict, archs: list[str], supported: list[str]):
    raise UnsupportedModelError(f"unsupported architecture {sorted(archs)}; supported: {supported}")
