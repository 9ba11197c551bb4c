"""Structured output's token masks applied to logits: the PyTorch reference and the engine's dispatch.

A mask is int32 `[rows, ceil(vocab / 32)]`, bit t of a row set when token t may be sampled (the step
protocol's `token_bitmask`, llguidance's layout). Greedy rows on the CPU take a masked argmax in the C++
kernels (kernels.cpu: nothing written over the vocabulary); rows that sample, or want logprobs, get the
disallowed logits set to -inf in place (C++ on the CPU, Triton on CUDA, this reference otherwise).
"""

from __future__ import annotations

import torch


def unpack_bitmask_ref(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool `[rows, vocab_size]`: which tokens each row allows."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Disallowed tokens' logits to -inf, in place."""
    _check(logits, bitmask)
    logits.masked_fill_(~unpack_bitmask_ref(bitmask, logits.shape[1]), float("-inf"))


def masked_argmax_ref(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Index of each row's largest allowed logit (the first on ties); -1 where a row allows nothing."""
    _check(logits, bitmask)
    allowed = unpack_bitmask_ref(bitmask, logits.shape[1])
    masked = logits.float().masked_fill(~allowed, float("-inf"))
    best = masked.max(dim=-1)
    # A row whose allowed logits are all -inf still picks its first allowed token.
    first_allowed = torch.where(allowed.any(-1), allowed.int().argmax(-1), -1)
    return torch.where(torch.isneginf(best.values), first_allowed, best.indices)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """`apply_token_bitmask_ref` on the fastest path for the device."""
    if logits.is_cuda:
        from kernels.triton_token_bitmask import apply_token_bitmask as triton_apply

        triton_apply(logits, bitmask)
        return
    mod = _cpu_kernels(logits)
    if mod is None:
        apply_token_bitmask_ref(logits, bitmask)
        return
    _check(logits, bitmask)
    mod.apply_token_bitmask(logits, bitmask)


def masked_argmax(logits: torch.Tensor, bitmask: torch.Tensor, hidden: torch.Tensor | None = None,
                  head_weight: torch.Tensor | None = None) -> torch.Tensor:
    """`masked_argmax_ref`; on the CPU in the C++ kernels, which with `hidden` and `head_weight` also
    rescore half-precision near-ties in float32 (as the unmasked exact argmax does)."""
    mod = _cpu_kernels(logits)
    if mod is None:
        if logits.is_cuda:
            scratch = logits.float()
            apply_token_bitmask(scratch, bitmask)
            best = scratch.max(dim=-1)
            return torch.where(torch.isneginf(best.values), masked_argmax_ref(logits, bitmask), best.indices)
        return masked_argmax_ref(logits, bitmask)
    _check(logits, bitmask)
    logits = logits.contiguous()
    if hidden is not None and head_weight is not None and logits.dtype != torch.float32:
        return mod.argmax_rows_exact_masked(logits, hidden.contiguous(), head_weight, bitmask)
    return mod.argmax_rows_masked(logits, bitmask)


def _cpu_kernels(logits: torch.Tensor):
    if logits.device.type != "cpu":
        return None
    import kernels.cpu as cpu_kernels

    return cpu_kernels.load()


def _check(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"token bitmask: logits [rows, vocab] and mask [rows, words], got {tuple(logits.shape)} "
                         f"and {tuple(bitmask.shape)}")
    if bitmask.dtype != torch.int32 or bitmask.shape[1] * 32 < logits.shape[1]:
        raise ValueError(f"token bitmask: int32 with at least {(logits.shape[1] + 31) // 32} words per row, got "
                         f"{bitmask.dtype} with {bitmask.shape[1]}")
    if bitmask.device != logits.device:
        raise ValueError(f"token bitmask: on {bitmask.device}, logits on {logits.device}")
