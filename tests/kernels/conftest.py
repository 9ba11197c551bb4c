"""Kernel tests run the Triton kernels through Triton's CPU interpreter, in float32 (TRITON_INTERPRET
is set by tests/conftest.py before any Triton kernel is defined)."""

import os

import pytest
import torch


@pytest.fixture
def gen(request) -> torch.Generator:
    """A fresh random seed per test, printed so that a failure can be replayed (KERNEL_TEST_SEED=<seed>)."""
    seed = int(os.environ.get("KERNEL_TEST_SEED") or int.from_bytes(os.urandom(8), "little") >> 1)
    print(f"{request.node.nodeid}: KERNEL_TEST_SEED={seed}")
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def poisoned(monkeypatch):
    """Kernel outputs and scratch buffers start NaN-filled, so an element a kernel never writes fails."""
    from kernels import triton_common

    def alloc(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(triton_common, "alloc", alloc)


@pytest.fixture
def assert_attention_close():
    """Judge a kernel's output three ways: against its reference, against float64 dense attention, and
    the reference against dense too (so a bug shared by kernel and reference cannot pass)."""
    from kernels.paged_inputs import rel_err

    def check(out: torch.Tensor, ref: torch.Tensor, dense: torch.Tensor, like: torch.Tensor, tol=1e-5):
        assert out.shape == like.shape and out.dtype == like.dtype, "output shape or dtype differs from q's"
        assert not out.isnan().any(), "unwritten or NaN output elements"
        for name, a, b in (("kernel vs reference", out, ref), ("kernel vs float64 dense", out, dense),
                           ("reference vs float64 dense", ref, dense)):
            assert rel_err(a, b) <= tol, f"{name}: relative error {rel_err(a, b):.3g} > {tol}"

    return check
