"""The engine's linear layers: which bfloat16 CPU GEMM runs where, and that each is as accurate as oneDNN."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu import load
from services import LLM, SamplingParams
from services.engine import linear
from services.engine.linear import Bf16GemmLinear, PackedLinear, cpu_gemm_choice, make_linear_factory

CPU = torch.device("cpu")
SMOLLM2_SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def _ours_available() -> bool:
    mod = load()
    return mod is not None and mod.bf16_gemm_supported()


needs_avx512_bf16 = pytest.mark.skipif(not _ours_available(), reason="no AVX512-BF16 build on this CPU")


def test_choice_follows_the_cpu_and_the_environment(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CPU_GEMM", "onednn")
    assert cpu_gemm_choice() == "onednn"
    # oneDNN packs bf16 weights only where the CPU has AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT; elsewhere the
    # factory falls back to F.linear rather than failing.
    expected = PackedLinear if linear._packing_works(torch.bfloat16) else linear.Linear
    assert isinstance(make_linear_factory(CPU, torch.bfloat16)(torch.randn(8, 8).bfloat16()), expected)
    monkeypatch.setenv("PAGEDSERVE_CPU_GEMM", "fastest")
    with pytest.raises(ValueError, match="PAGEDSERVE_CPU_GEMM"):
        cpu_gemm_choice()
    monkeypatch.setenv("PAGEDSERVE_CPU_GEMM", "auto")
    mod = load()
    if not _ours_available():
        assert cpu_gemm_choice() == "onednn"
        return
    monkeypatch.setenv("PAGEDSERVE_CPU_AMX", "0")  # the non-AMX path, on any machine
    assert cpu_gemm_choice() == "avx512"
    monkeypatch.delenv("PAGEDSERVE_CPU_AMX")
    assert cpu_gemm_choice() == ("onednn" if mod.amx_available() else "avx512")
    monkeypatch.setenv("PAGEDSERVE_CPU_GEMM", "avx512")
    assert isinstance(make_linear_factory(CPU, torch.bfloat16)(torch.randn(8, 8).bfloat16()), Bf16GemmLinear)
    # float32 keeps F.linear whatever is chosen: its results match Hugging Face's.
    assert isinstance(make_linear_factory(CPU, torch.float32)(torch.randn(8, 8)), linear.Linear)


@needs_avx512_bf16
@pytest.mark.parametrize("m", [1, 16, 64, 300])
@pytest.mark.parametrize("name", sorted(SMOLLM2_SHAPES))
def test_as_accurate_as_onednn_at_smollm2_shapes(monkeypatch, name, m):
    n, k = SMOLLM2_SHAPES[name]
    g = torch.Generator().manual_seed(m + n + k)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16() if name == "qkv" else None
    x = torch.randn(m, k, generator=g).bfloat16()
    want = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    ours = Bf16GemmLinear(load(), w, bias)(x)
    onednn = PackedLinear(w, bias, 64)(x)
    err_ours, err_onednn = (ours.float() - want).abs().max(), (onednn.float() - want).abs().max()
    assert err_ours <= err_onednn * 1.25 + 1e-6, (err_ours, err_onednn)


@needs_avx512_bf16
def test_engine_generates_the_same_with_either_gemm(monkeypatch, tiny_model_dir):
    prompt = list(range(1000, 1040))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    outs = {}
    for choice in ("onednn", "avx512"):
        monkeypatch.setenv("PAGEDSERVE_CPU_GEMM", choice)
        llm = LLM(model=str(tiny_model_dir), dtype="bfloat16")
        outs[choice] = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert outs["avx512"].token_ids[0] == outs["onednn"].token_ids[0]
    assert abs(outs["avx512"].logprobs[0].logprob - outs["onednn"].logprobs[0].logprob) < 0.3
