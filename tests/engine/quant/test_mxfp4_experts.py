"""gpt-oss's MXFP4 experts served as stored: a tiny random gpt-oss checkpoint (transformers' own classes,
attention sinks, windows, YaRN, biased router, clamped SwiGLU) whose experts are written here as
`*_blocks` / `*_scales` in transformers' Mxfp4 layout.

- transformers itself loads the MXFP4 file (dequantizing it on the CPU) to exactly the weights the writer
  decoded, so the layout written is the one real checkpoints have;
- pagedserve's float32 greedy output equals transformers' on those dequantized weights, with chunked
  prefill, prefix hits and preemption forced, at 1 and 2 ranks; bfloat16 (the C++ GEMM decoding e2m1
  inside the kernel) within the Llama tests' tolerance of float32;
- the experts stay packed: the engine's own accounting holds them at ~4.25 bits per weight;
- where they cannot run (the Triton expert kernel) they are refused by name."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from services import LLM, SamplingParams
from services.engine.models.spec import UnsupportedModelError
from tests.engine.conftest import hf_greedy, make_tiny_model
from tests.engine.models.test_families import VARIANTS, prompts_for, run_and_check
from tests.engine.quant import checkpoint_writers as w

MAX_TOKENS = 12
EXPERTS = ("experts.gate_up_proj", "experts.down_proj")


@pytest.fixture(scope="module")
def mxfp4_model(tmp_path_factory):
    """(MXFP4 checkpoint, its dequantized twin, prompts, transformers' greedy tokens on the twin)."""
    root = tmp_path_factory.mktemp("mxfp4")
    src = make_tiny_model(root / "float", "gpt_oss", perturb_norms=True, **VARIANTS["gpt-oss-sinks"][1])
    out, ref = root / "quantized", root / "reference"
    w.write_mxfp4(src, out, ref)
    hf = AutoModelForCausalLM.from_pretrained(str(ref), dtype=torch.float32).eval()
    prompts = prompts_for("gpt-oss-mxfp4", 12)
    return out, ref, prompts, [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]


def test_transformers_reads_the_written_file_as_the_writer_decoded_it(mxfp4_model):
    out, ref, _, _ = mxfp4_model
    hf_q = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    hf_ref = AutoModelForCausalLM.from_pretrained(str(ref), dtype=torch.float32).eval()
    got, want = dict(hf_q.named_parameters()), dict(hf_ref.named_parameters())
    experts = [n for n in want if n.endswith(EXPERTS)]
    assert len(experts) == 2 * VARIANTS["gpt-oss-sinks"][1].get("num_hidden_layers", 2)
    for name in experts:
        assert torch.equal(got[name].float(), want[name]), name


def test_float32_greedy_matches_transformers_on_the_dequantized_experts(mxfp4_model):
    out, _, prompts, want = mxfp4_model
    llm = LLM(model=str(out), dtype="float32", block_size=4, max_num_batched_tokens=16, num_kv_blocks=400)
    moe = [layer.moe for layer in llm.runner.model.layers]
    assert all(m.packed.kind == "callable" for m in moe), "the experts are the quantized linears"
    run_and_check("mxfp4", llm, prompts, want)


def test_two_ranks_match_transformers(mxfp4_model):
    out, _, prompts, want = mxfp4_model
    with LLM(model=str(out), dtype="float32", block_size=4, max_num_batched_tokens=16, num_kv_blocks=400,
             tensor_parallel_size=2) as llm:
        run_and_check("mxfp4 at 2 ranks", llm, prompts, want)


def test_bfloat16_runs_the_kernel_and_stays_close_to_float32(mxfp4_model):
    out, _, prompts, _ = mxfp4_model
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=0)
    got = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(model=str(out), dtype=dtype, block_size=4, num_kv_blocks=400)
        got[dtype] = llm.generate(prompts[2:3], params, use_tqdm=False)[0].outputs[0]
        if dtype == "bfloat16":
            from kernels.cpu import load

            mod = load()
            linear = llm.runner.model.layers[0].moe.packed.gate_up[0]
            assert (linear.mod is not None) == (mod is not None and mod.quant_gemm_supported())
    a, b = got["float32"], got["bfloat16"]
    assert a.token_ids[0] == b.token_ids[0]
    assert abs(a.logprobs[0].logprob - b.logprobs[0].logprob) < 0.3


def test_the_experts_stay_packed(mxfp4_model):
    out, ref, _, _ = mxfp4_model
    packed = LLM(model=str(out), dtype="bfloat16", num_kv_blocks=64).runner.model.weight_bytes
    plain = LLM(model=str(ref), dtype="bfloat16", num_kv_blocks=64).runner.model.weight_bytes
    o = VARIANTS["gpt-oss-sinks"][1]
    hidden, inter, experts = 64, 128, o["num_local_experts"]
    expert_values = 2 * experts * 3 * hidden * inter  # 2 layers, gate + up + down per expert
    # 4 bits per value and one float16 scale (a power of two float16 holds) per 32: 4.5 bits, against 16.
    saved = plain - packed
    assert saved == pytest.approx(expert_values * 2 * (1 - 4.5 / 16), rel=0.02), (plain, packed)


def test_the_triton_expert_kernel_refuses_them(mxfp4_model):
    out, _, _, _ = mxfp4_model
    with pytest.raises(UnsupportedModelError, match="MXFP4"):
        LLM(model=str(out), dtype="float32", num_kv_blocks=64, attention_backend="triton")


def test_a_nan_scale_is_refused_naming_the_tensor():
    from services.engine.quant.formats import mxfp4

    blocks = torch.zeros(4, 2, 16, dtype=torch.uint8)
    scales = torch.full((4, 2), 127, dtype=torch.uint8)
    assert mxfp4.read_expert(blocks, scales, "ok").source == "ok"
    scales[2, 1] = 255
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.experts\.down_proj_scales.*255.*rows \[2\]"):
        mxfp4.read_expert(blocks, scales, "layers.0.mlp.experts.down_proj_scales")

