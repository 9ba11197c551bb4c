"""Structured output's token masks: the C++ masked argmax and in-place mask, and the Triton mask (through
the interpreter, float32), against the PyTorch reference, which is itself checked against plain Python."""

from __future__ import annotations

import pytest
import torch

from kernels.token_bitmask import apply_token_bitmask_ref, masked_argmax, masked_argmax_ref, unpack_bitmask_ref


@pytest.fixture(scope="module")
def ext():
    from kernels.cpu import load

    assert load() is not None, "the CPU kernels did not compile (a C++ compiler and ninja are part of `make install`)"
    return load()


def random_masks(gen, rows: int, vocab: int) -> torch.Tensor:
    """Rows of every kind a grammar produces: sparse, one token, none, all, only the last partial word."""
    words = (vocab + 31) // 32
    m = torch.randint(-2**31, 2**31 - 1, (rows, words), dtype=torch.int32, generator=gen)
    m[0] &= torch.randint(-2**31, 2**31 - 1, (words,), dtype=torch.int32, generator=gen)  # sparser
    m[1] = 0
    m[1, 5] = 1 << 3  # token 163 alone
    m[2] = 0  # nothing allowed
    m[3] = -1  # everything
    m[4] = 0
    m[4, words - 1] = -1  # the tail of the vocabulary only
    return m


def test_reference_unpacks_bits_in_llguidance_order():
    mask = torch.tensor([[0b101, -2**31]], dtype=torch.int32)  # bits 0, 2 and 63
    allowed = unpack_bitmask_ref(mask, 64)[0].nonzero().flatten().tolist()
    assert allowed == [0, 2, 63]
    logits = torch.zeros(1, 64)
    apply_token_bitmask_ref(logits, mask)
    assert [i for i in range(64) if logits[0, i] == 0] == [0, 2, 63]
    assert masked_argmax_ref(torch.arange(64.0).unsqueeze(0), mask).tolist() == [63]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_masked_argmax_and_apply_match_the_reference(ext, gen, dtype):
    vocab = 5000 + 7  # a partial last word, several argmax chunks
    x = torch.randn(7, vocab, generator=gen).to(dtype)
    x[5] = float("-inf")  # every allowed logit -inf: still an allowed token
    x[6, 1000] = x[6, 4000] = 50  # a tie across chunks: the first allowed one wins
    mask = random_masks(gen, 7, vocab)
    mask[6] = -1
    want = masked_argmax_ref(x, mask)
    assert ext.argmax_rows_masked(x, mask).tolist() == want.tolist()
    assert want[2] == -1 and want[1] == 163 and want[6] == 1000
    assert bool(unpack_bitmask_ref(mask, vocab)[5, want[5]])
    for y in (x.clone(), x.float()):
        expected = y.clone()
        apply_token_bitmask_ref(expected, mask)
        ext.apply_token_bitmask(y, mask)
        assert torch.equal(y, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_exact_masked_argmax_picks_the_best_allowed_token_in_float32(ext, gen, dtype):
    hidden = torch.randn(5, 96, generator=gen).to(dtype)
    weight = (torch.randn(3000, 96, generator=gen) * 0.3).to(dtype)
    exact = hidden.float() @ weight.float().T
    mask = random_masks(gen, 5, 3000)
    allowed = unpack_bitmask_ref(mask, 3000)
    want = exact.masked_fill(~allowed, float("-inf")).max(-1).indices
    got = masked_argmax(exact.to(dtype), mask, hidden, weight)
    for r in range(5):
        assert got[r].item() == (-1 if not allowed[r].any() else want[r].item())


def test_triton_apply_matches_the_reference(gen):
    pytest.importorskip("triton")
    from kernels.triton_token_bitmask import apply_token_bitmask

    for vocab in (1000, 4096 + 33):
        x = torch.randn(5, vocab, generator=gen)
        mask = random_masks(gen, 5, vocab)
        expected = x.clone()
        apply_token_bitmask_ref(expected, mask)
        apply_token_bitmask(x, mask)
        assert torch.equal(x, expected)
