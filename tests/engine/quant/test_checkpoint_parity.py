"""Each quantized format, written here in its exact on-disk layout from a random Llama-shaped and a
Qwen3-shaped model (per-head q/k norms, a head_dim of its own; and one Qwen2-shaped variant): pagedserve's
greedy output in float32 is token-identical to transformers running the dequantized weights (with the
checkpoint's activation quantization applied to every quantized layer's input, for W8A8 checkpoints); in
bfloat16, through the C++ quantized GEMM, within the Llama tests' tolerance of float32. Chunked prefill
and preemption are active, as in tests/engine/test_llama.py; a tie in transformers' own logits is the only
accepted difference, and the test says so when one happens. The projections stay packed in memory."""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

from services import LLM, SamplingParams
from tests.engine.conftest import hf_greedy
from tests.engine.quant import checkpoint_writers as w

VARIANTS = {
    "gptq-4bit-g32-sym": (w.write_gptq, {"bits": 4, "group": 32, "sym": True}),
    "gptq-4bit-g16-asym-desc_act": (w.write_gptq, {"bits": 4, "group": 16, "sym": False, "desc_act": True}),
    "gptq-8bit-channel-asym-v2": (w.write_gptq, {"bits": 8, "group": -1, "sym": False, "v2": True}),
    "awq-4bit-g32": (w.write_awq, {"group": 32}),
    "ct-w4a16-g32": (w.write_ct_packed, {"bits": 4, "group": 32}),
    "ct-w4a16-g16-asym-actorder": (w.write_ct_packed, {"bits": 4, "group": 16, "sym": False, "actorder": True}),
    "ct-w8a16-packed-g64": (w.write_ct_packed, {"bits": 8, "group": 64}),
    "ct-int8-w8a8": (w.write_ct_int8, {}),
    "ct-fp8-channel-dynamic": (w.write_ct_fp8, {"strategy": "channel"}),
    "ct-fp8-tensor-static": (w.write_ct_fp8, {"strategy": "tensor", "static": True}),
    "fp8-block-48x32": (w.write_fp8, {"block": (48, 32)}),
    "fp8-tensor": (w.write_fp8, {"block": None}),
}
QWEN2 = {"qwen2-gptq-4bit-g32-asym": (w.write_gptq, {"bits": 4, "group": 32, "sym": False})}


def quantize_like_the_checkpoint(x: torch.Tensor, act: dict) -> torch.Tensor:
    """The checkpoint's activation quantization, written from its definition (q * s, s from the absmax)."""
    top = 448.0 if act["dtype"] == "fp8" else 127.0
    shape = x.shape
    x = x.reshape(-1, shape[-1]).float()
    if act.get("static_scale"):
        s = torch.tensor(act["static_scale"])
    elif act["granularity"] == "token":
        s = x.abs().amax(-1, keepdim=True).clamp_min(1e-12) / top
    else:
        g = act["group"]
        s = (x.view(x.shape[0], -1, g).abs().amax(-1, keepdim=True).clamp_min(1e-12) / top)
        s = s.expand(-1, -1, g).reshape(x.shape)
    if act["dtype"] == "fp8":
        q = (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    else:
        q = torch.round(x / s).clamp(-128, 127)
    return (q * s).reshape(shape)


def reference_model(ref_dir, act: dict | None):
    hf = AutoModelForCausalLM.from_pretrained(str(ref_dir), dtype=torch.float32).eval()
    if act is not None:
        for name, mod in hf.named_modules():
            if isinstance(mod, torch.nn.Linear) and "lm_head" not in name:
                mod.register_forward_pre_hook(lambda _m, args: (quantize_like_the_checkpoint(args[0], act),))
    return hf


def write(variant, float_models, tmp_path, arch: str = "llama"):
    writer, kwargs = {**VARIANTS, **QWEN2}[variant]
    arch = "qwen2" if variant in QWEN2 else arch
    out, ref = tmp_path / "quantized", tmp_path / "reference"
    act = writer(float_models[arch], out, ref, **kwargs)
    return out, ref, act


@pytest.mark.parametrize("arch,variant", [("llama", v) for v in sorted({**VARIANTS, **QWEN2})]
                         + [("qwen3", v) for v in sorted(VARIANTS)])
def test_float32_greedy_matches_transformers_on_the_dequantized_weights(arch, variant, float_models, tmp_path):
    out, ref, act = write(variant, float_models, tmp_path, arch)
    rng = random.Random(sum(map(ord, variant)))
    prompts = [[rng.randrange(100, 49152) for _ in range(n)] for n in (3, 17, 40, 90)]
    llm = LLM(model=str(out), dtype="float32", block_size=16, num_kv_blocks=12, max_num_batched_tokens=32)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert llm.core.scheduler.num_preemptions > 0, "the pool is sized so that preemption happens"
    hf = reference_model(ref, act)
    for p, o in zip(prompts, outs, strict=True):
        equal_or_tie(hf, p, o.outputs[0].token_ids, hf_greedy(hf, p, 16), f"{arch} {variant}: {len(p)}-token prompt")


TIE = 0.02  # logits; float32 sums in another order (chunked prefill) move a logit by far less


def equal_or_tie(hf, prompt: list[int], got: list[int], want: list[int], what: str) -> None:
    """Token-identical, or the first difference is a tie in transformers' own logits: pagedserve took its
    runner-up within TIE of its choice (W8A8's per-token activation rounding can turn a float32 difference
    in the last bits into a different e4m3 code, so a near-tie can flip). Said when it happens."""
    if got == want:
        return
    i = next(j for j in range(len(want)) if got[j] != want[j])
    with torch.no_grad():
        top = torch.topk(hf(torch.tensor([prompt + want[:i]])).logits[0, -1], 2)
    margin = float(top.values[0] - top.values[1])
    assert got[i] == int(top.indices[1]) and margin < TIE, f"{what} diverged at token {i} (margin {margin:.4f})"
    warnings.warn(f"{what}: a tie in transformers' logits at token {i} (margin {margin:.4f}); the rest not compared",
                  stacklevel=2)


@pytest.mark.parametrize("variant", ["gptq-4bit-g16-asym-desc_act", "awq-4bit-g32", "ct-int8-w8a8",
                                     "ct-w8a16-packed-g64", "fp8-block-48x32", "ct-fp8-tensor-static"])
def test_bfloat16_stays_close_to_float32(variant, float_models, tmp_path):
    out, _, _ = write(variant, float_models, tmp_path)
    prompt = list(range(1000, 1040))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    a = LLM(model=str(out), dtype="float32").generate([prompt], params, use_tqdm=False)[0].outputs[0]
    b = LLM(model=str(out), dtype="bfloat16").generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert a.token_ids[0] == b.token_ids[0]
    assert abs(a.logprobs[0].logprob - b.logprobs[0].logprob) < 0.3  # the Llama tests' tolerance


@pytest.mark.parametrize("variant,bits", [("fp8-block-48x32", 8), ("ct-fp8-channel-dynamic", 8), ("ct-int8-w8a8", 8),
                                          ("gptq-4bit-g32-sym", 4), ("awq-4bit-g32", 4), ("ct-w4a16-g32", 4)])
def test_the_projections_stay_packed(variant, bits, float_models, tmp_path):
    """The decoder projections' bytes as the engine accounts them, against the same model in bf16: codes
    at `bits` per weight plus each format's scales (and zero points) as stored; the embedding and norms,
    which the formats leave alone, are the same in both and cancel."""
    out, ref, _ = write(variant, float_models, tmp_path)
    packed = LLM(model=str(out), dtype="bfloat16", num_kv_blocks=64).runner.model.weight_bytes
    plain = LLM(model=str(ref), dtype="bfloat16", num_kv_blocks=64).runner.model.weight_bytes
    hidden, inter, layers = 64, 128, 2
    projections = layers * (hidden * (hidden + 2 * 32 + hidden) + 3 * hidden * inter)  # q, k, v (2 heads), o, MLP
    ratio = (packed - (plain - 2 * projections)) / (2 * projections)
    print(f"{variant}: projections {ratio:.3f}x bf16")
    # 8-bit codes cost 0.5x bf16 and 4-bit ones 0.25x; scales (a float per row, per block or per 32 columns,
    # and GPTQ/AWQ's zero points) add at most 0.1x here.
    assert bits / 16 <= ratio <= bits / 16 + 0.1, ratio


# The Triton quantized GEMM (CUDA's path) through the whole engine, under the interpreter in float32: 4-bit
# with act-order, 8-bit packed, block FP8 with its dynamic activations; transformers' tokens.
@pytest.mark.parametrize("variant", ["gptq-4bit-g16-asym-desc_act", "ct-w8a16-packed-g64", "fp8-block-48x32"])
def test_the_triton_gemm_serves_the_formats(variant, float_models, tmp_path, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("PAGEDSERVE_QUANT_KERNEL", "triton")
    out, ref, act = write(variant, float_models, tmp_path)
    rng = random.Random(len(variant))
    prompts = [[rng.randrange(100, 49152) for _ in range(n)] for n in (5, 21)]
    llm = LLM(model=str(out), dtype="float32", block_size=16, num_kv_blocks=64, attention_backend="reference")
    assert llm.runner.model.layers[0].o.triton  # o_proj: one packed module in every variant
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    hf = reference_model(ref, act)
    for p, o in zip(prompts, outs, strict=True):
        equal_or_tie(hf, p, o.outputs[0].token_ids, hf_greedy(hf, p, 6), f"{variant} on Triton")
