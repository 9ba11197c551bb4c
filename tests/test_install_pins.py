"""The installed packages do not collide with this repository's top-level packages.

transformers 5.25 depends on Hugging Face's `kernels` distribution and, when it is installed, runs
`from kernels import CUDAProperties, ...` inside `import transformers.activations`: with this repository
on the path that finds pagedserve's `kernels` package and every model load fails. pyproject.toml pins
transformers below 5.25; these tests fail if an install brings that distribution back."""

from __future__ import annotations

import importlib.metadata

import pytest


def test_no_installed_distribution_is_named_like_the_kernels_package():
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("kernels")


def test_transformers_imports_with_this_repositorys_kernels_on_the_path():
    import transformers.activations  # the import that failed under transformers 5.25

    import kernels

    assert kernels.__file__.endswith("kernels/__init__.py")
    assert transformers.activations.ACT2FN["silu"] is not None
