"""The Triton LoRA shrink/expand (kernels/triton_lora.py) against plain torch, through the interpreter:
mixed adapters and base-model tokens in one batch, fused projections of several parts, ranks below the
padded one."""

import pytest
import torch

pytest.importorskip("triton")

from kernels.triton_lora import lora_apply  # noqa: E402


def reference(x, out, a, b, slots, scales, parts, r):
    out = out.clone()
    for t in range(x.shape[0]):
        s = int(slots[t])
        if s < 0:
            continue
        xa = a[s].float() @ x[t].float()
        for j, (off, size) in enumerate(parts):
            out[t, off:off + size] += (b[s, off:off + size].float() @ xa[j * r:(j + 1) * r] * scales[s]).to(out.dtype)
    return out


@pytest.mark.parametrize("parts", [[(0, 40)], [(0, 24), (24, 8), (32, 8)]])  # o_proj-like; a fused qkv
def test_mixed_adapters_and_base_tokens_match_torch(gen, parts):
    slots_n, r, k, tokens = 3, 8, 72, 11
    n = sum(size for _, size in parts)
    a = torch.randn(slots_n, len(parts) * r, k, generator=gen)
    b = torch.randn(slots_n, n, r, generator=gen)
    a[1].view(len(parts), r, k)[:, 4:] = 0  # slot 1 holds a rank-4 adapter, zero-padded
    b[1, :, 4:] = 0
    x = torch.randn(tokens, k, generator=gen)
    out = torch.randn(tokens, n, generator=gen)
    token_slots = torch.tensor([0, -1, 2, 2, 1, -1, 0, 1, 2, -1, 0], dtype=torch.int32)
    scales = torch.tensor([2.0, 0.5, 1.0])
    want = reference(x, out, a, b, token_slots, scales, parts, r)
    lora_apply(x, out, a, b, token_slots, scales, parts, r)
    # float32 sums in another order: terms reach ~50 here (x.a sums 72 products, then b.xa 8 more), so an
    # element that cancels to near 0 carries ~1e-5 of absolute rounding; atol follows the terms' scale.
    torch.testing.assert_close(out, want, rtol=1e-5, atol=2e-4)
    assert torch.equal(out[1], want[1]) and torch.equal(out[5], want[5])  # base tokens untouched


def test_only_base_tokens_change_nothing_and_bad_shapes_are_refused(gen):
    a, b = torch.randn(2, 8, 16, generator=gen), torch.randn(2, 12, 8, generator=gen)
    x, out = torch.randn(3, 16, generator=gen), torch.randn(3, 12, generator=gen)
    before = out.clone()
    lora_apply(x, out, a, b, torch.full((3,), -1, dtype=torch.int32), torch.ones(2), [(0, 12)], 8)
    assert torch.equal(out, before)
    with pytest.raises(ValueError, match="int32"):
        lora_apply(x, out, a, b, torch.zeros(3, dtype=torch.int64), torch.ones(2), [(0, 12)], 8)
    with pytest.raises(ValueError, match="do not fit"):
        lora_apply(x, out, a, b, torch.zeros(3, dtype=torch.int32), torch.ones(2), [(0, 6), (6, 6)], 8)
