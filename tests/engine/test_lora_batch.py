"""One step's LoRA application (services/engine/lora/batch.py): the torch path over the slots a step uses and the Triton
kernel's path (through the interpreter) against a per-token reference, with several adapters of other
ranks and base-model tokens in one step, a span that does not start at the first token, and fused
projections."""

from __future__ import annotations

import types

import pytest
import torch

from services.engine.lora.batch import LoraBatch
from services.engine.lora.slots import LoraSlots
from services.engine.lora.weights import load_weights
from tests.engine.test_lora_tensor_parallel import _adapter_files

CONFIG = types.SimpleNamespace(hidden_size=24, intermediate_size=40, head_dim=4, num_heads=6, num_kv_heads=2,
                               num_layers=1)
GROUP_IN = {"qkv": 24, "o": 24, "gate_up": 24, "down": 40}


def _slots() -> tuple[LoraSlots, list]:
    slots = LoraSlots(CONFIG, None, 3, 8, torch.float32, torch.device("cpu"), 3)
    files = [_adapter_files(CONFIG, rank, seed) for rank, seed in ((8, 1), (4, 2), (8, 3))]
    for slot, f in enumerate(files):
        slots.add(load_weights(f, CONFIG, torch.float32, None), f.path)
        slots.activate(slot, f.digest)
    return slots, files


def _reference(slots: LoraSlots, token_slot: list[int], group: str, x: torch.Tensor, out: torch.Tensor):
    out = out.clone()
    a_all, b_all, r = slots.a[0][group], slots.b[0][group], slots.max_rank
    for t, s in enumerate(token_slot):
        if s < 0:
            continue
        xa = a_all[s] @ x[t]
        for j, (off, size) in enumerate(slots.parts[group]):
            out[t, off:off + size] += (b_all[off:off + size, s] @ xa[j * r:(j + 1) * r]) * slots.scales[s]
    return out


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_a_step_of_three_adapters_and_base_tokens(kernel, monkeypatch):
    if kernel == "triton":
        pytest.importorskip("triton")
        monkeypatch.setenv("PAGEDSERVE_LORA_KERNEL", "triton")
    slots, _ = _slots()
    # tokens 0-1 base, 2-4 slot 2, 5 base, 6-7 slot 0, 8-10 slot 1, 11 base
    segments = [(-1, 0, 2), (2, 2, 5), (-1, 5, 6), (0, 6, 8), (1, 8, 11), (-1, 11, 12)]
    token_slot = [-1, -1, 2, 2, 2, -1, 0, 0, 1, 1, 1, -1]
    batch = LoraBatch.of(slots, segments, torch.device("cpu"))
    assert (batch.lo, batch.hi, batch.triton) == (2, 11, kernel == "triton")
    gen = torch.Generator().manual_seed(0)
    for group, fan_in in GROUP_IN.items():
        x = torch.randn(12, fan_in, generator=gen)
        out = torch.randn(12, sum(size for _, size in slots.parts[group]), generator=gen)
        want = _reference(slots, token_slot, group, x, out)
        batch.apply(0, group, x, out)
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
        for t in (0, 1, 5, 11):  # base tokens: not a bit changed
            assert torch.equal(out[t], want[t])


@pytest.mark.parametrize("used", [[1], [2], [1, 2]])
def test_a_step_using_some_slots_computes_only_their_range(used):
    slots, _ = _slots()
    token_slot = [-1] + [s for s in used for _ in range(3)] + [-1]
    segments, at = [], 0
    for s in token_slot:
        segments.append((s, at, at + 1))
        at += 1
    batch = LoraBatch.of(slots, segments, torch.device("cpu"))
    assert (batch.first, batch.end) == (min(used), max(used) + 1)
    assert batch.weight.shape[1] == max(used) + 1 - min(used)
    gen = torch.Generator().manual_seed(1)
    for group, fan_in in GROUP_IN.items():
        x = torch.randn(len(token_slot), fan_in, generator=gen)
        out = torch.randn(len(token_slot), sum(size for _, size in slots.parts[group]), generator=gen)
        want = _reference(slots, token_slot, group, x, out)
        batch.apply(0, group, x, out)
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)


def test_a_step_without_adapter_tokens_has_no_batch():
    slots, _ = _slots()
    assert LoraBatch.of(slots, [(-1, 0, 5)], torch.device("cpu")) is None
    assert LoraBatch.of(slots, [(0, 3, 3)], torch.device("cpu")) is None
