"""The fused expert (MoE) computation: the reference against transformers' expert modules and a float64
all-experts product; the grouping's invariants; the CPU path and the Triton kernel (interpreter, float32)
against the reference on random routings, including an expert no token chose, one expert taking every
pair, top-1, a token naming one expert in several slots, equal routing weights, biases and both
activations; bfloat16 on the CPU path at a tolerance; and that the CPU path never runs an inactive expert.
"""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels
from kernels import moe_cpu
from kernels.moe_align import align_block_size, group_by_expert, max_padded_rows
from kernels.moe_cpu import fused_experts_cpu, pack_experts_cpu
from kernels.moe_reference import ACTIVATIONS, fused_experts_ref

ROUTINGS = ("topk", "repeats", "one_expert", "skip_expert")


def make_routing(g: torch.Generator, tokens: int, experts: int, top_k: int, routing: str):
    """topk_ids [T, K] int64 in one of four shapes: distinct experts per token (a real router's), ids drawn
    with repeats (a token may name one expert twice), every pair on one expert, expert 0 never chosen."""
    if routing == "topk" and top_k <= experts:
        return torch.rand(tokens, experts, generator=g).argsort(dim=1)[:, :top_k]
    if routing == "one_expert":
        return torch.full((tokens, top_k), int(torch.randint(experts, (1,), generator=g)), dtype=torch.long)
    if routing == "skip_expert" and experts > 1:
        return torch.randint(1, experts, (tokens, top_k), generator=g)
    return torch.randint(0, experts, (tokens, top_k), generator=g)


def make_case(g: torch.Generator, tokens: int, hidden: int, inter: int, experts: int, top_k: int, routing: str, *,
              bias: bool = False, equal_weights: bool = False, dtype=torch.float32):
    # Scales keep every product O(1): x ~ 1, weights ~ 1/sqrt(fan-in), so the activation sees gates of
    # order 1 and gpt-oss's clamp at 7 bites only on its tails.
    x = torch.randn(tokens, hidden, generator=g)
    w_gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) * 2 / hidden ** 0.5
    w_down = torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5
    ids = make_routing(g, tokens, experts, top_k, routing)
    weights = torch.full((tokens, top_k), 1 / top_k) if equal_weights else torch.rand(tokens, top_k, generator=g)
    b_gate_up = torch.randn(experts, 2 * inter, generator=g) if bias else None
    b_down = torch.randn(experts, hidden, generator=g) if bias else None
    cast = (lambda t: None if t is None else t.to(dtype))
    return dict(x=cast(x), w_gate_up=cast(w_gate_up), w_down=cast(w_down), topk_ids=ids, topk_weights=weights,
                b_gate_up=cast(b_gate_up), b_down=cast(b_down))


def dense_all_experts(case, activation: str) -> torch.Tensor:
    """float64, every expert on every token (einsum), then each pair's row picked: no grouping at all."""
    d = {k: (v.double() if v is not None and v.is_floating_point() else v) for k, v in case.items()}
    inter = d["w_down"].shape[2]
    gate_up = torch.einsum("th,eoh->teo", d["x"], d["w_gate_up"])
    if d["b_gate_up"] is not None:
        gate_up = gate_up + d["b_gate_up"]
    h = kernels.moe_activation(gate_up[..., :inter], gate_up[..., inter:], activation)
    y = torch.einsum("tei,ehi->teh", h, d["w_down"])
    if d["b_down"] is not None:
        y = y + d["b_down"]
    picked = y[torch.arange(y.shape[0])[:, None], d["topk_ids"]]  # [T, K, H]
    return (picked * d["topk_weights"][..., None]).sum(1)


def ref(case, activation: str) -> torch.Tensor:
    return fused_experts_ref(**case, activation=activation)


def assert_f32_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    # float32 sums of <= 64 O(1) products in another order: a few 1e-7 relative.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# --- the reference --------------------------------------------------------------------------------


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("bias", [False, True])
def test_reference_matches_a_dense_float64_product(gen, activation, bias):
    for routing in ROUTINGS:
        case = make_case(gen, 9, 24, 16, 5, 2, routing, bias=bias)
        torch.testing.assert_close(ref(case, activation).double(), dense_all_experts(case, activation),
                                   rtol=1e-5, atol=1e-5)


def test_reference_matches_transformers_mixtral_experts(gen):
    modeling = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    case = make_case(gen, 11, 32, 16, 6, 2, "topk")
    config = types.SimpleNamespace(num_local_experts=6, hidden_size=32, intermediate_size=16, hidden_act="silu",
                                   _experts_implementation="eager")  # the plain loop, not a kernel
    experts = modeling.MixtralExperts(config)
    with torch.no_grad():  # transformers 5's layout is ours: [E, 2I, H] gate rows then up rows; [E, H, I]
        experts.gate_up_proj.copy_(case["w_gate_up"])
        experts.down_proj.copy_(case["w_down"])
        want = experts(case["x"], case["topk_ids"], case["topk_weights"])
    torch.testing.assert_close(ref(case, "silu"), want, rtol=1e-5, atol=1e-5)


def test_reference_matches_transformers_gpt_oss_experts(gen):
    modeling = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    tokens, hidden, inter, experts_n = 10, 32, 16, 4
    case = make_case(gen, tokens, hidden, inter, experts_n, 2, "topk", bias=True)
    case["x"] = case["x"] * 4  # gates past the clamp at 7, ups past +-7: the limits matter
    config = types.SimpleNamespace(num_local_experts=experts_n, hidden_size=hidden, intermediate_size=inter,
                                   swiglu_alpha=1.702, swiglu_limit=7.0, _experts_implementation="eager")
    experts = modeling.GptOssExperts(config)
    w_gu, b_gu = case["w_gate_up"], case["b_gate_up"]
    # The checkpoint's layout: [E, H, 2I] with gate and up columns interleaved (gate at even columns).
    interleaved = torch.stack([w_gu[:, :inter], w_gu[:, inter:]], dim=2).reshape(experts_n, 2 * inter, hidden)
    interleaved_bias = torch.stack([b_gu[:, :inter], b_gu[:, inter:]], dim=2).reshape(experts_n, 2 * inter)
    with torch.no_grad():
        experts.gate_up_proj.copy_(interleaved.transpose(1, 2))
        experts.gate_up_proj_bias.copy_(interleaved_bias)
        experts.down_proj.copy_(case["w_down"].transpose(1, 2))
        experts.down_proj_bias.copy_(case["b_down"])
        want = experts(case["x"], case["topk_ids"], case["topk_weights"])
    gate = case["x"] @ w_gu[0, :inter].T
    assert gate.abs().max() > 7, "inputs too small to reach the clamp"
    torch.testing.assert_close(ref(case, "gpt_oss_swiglu"), want, rtol=1e-5, atol=1e-4)


def test_entry_points_refuse_bad_arguments(gen):
    case = make_case(gen, 4, 16, 8, 3, 2, "topk")
    for fn in (fused_experts_ref, fused_experts_cpu):
        with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, 3\)"):
            fn(**{**case, "topk_ids": case["topk_ids"] + 3})
        with pytest.raises(ValueError, match="w_down"):
            fn(**{**case, "w_down": case["w_down"][:, :, :4]})
        with pytest.raises(ValueError, match="topk_weights"):
            fn(**{**case, "topk_weights": case["topk_weights"][:, :1]})
        with pytest.raises(TypeError, match="w_gate_up"):
            fn(**{**case, "w_gate_up": case["w_gate_up"].double()})
        with pytest.raises(ValueError, match="activation"):
            fn(**case, activation="gelu")
    packed = pack_experts_cpu(case["w_gate_up"], case["w_down"])
    with pytest.raises(ValueError, match="biases are the packed ones"):
        fused_experts_cpu(case["x"], None, None, case["topk_ids"], case["topk_weights"], packed=packed,
                          b_down=torch.zeros(3, 16))


# --- the grouping ---------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(tokens=st.integers(0, 40), experts=st.integers(1, 9), top_k=st.integers(1, 4),
       block_m=st.sampled_from([1, 4, 16]), routing=st.sampled_from(ROUTINGS), seed=st.integers(0, 2 ** 31))
def test_grouping_and_block_alignment_invariants(tokens, experts, top_k, block_m, routing, seed):
    ids = make_routing(torch.Generator().manual_seed(seed), tokens, experts, top_k, routing)
    flat = ids.reshape(-1)
    groups = group_by_expert(ids, experts)
    assert torch.equal(groups.counts, torch.bincount(flat, minlength=experts))
    for e in range(experts):  # expert e's run: exactly its pairs, in token order
        run = groups.sorted_ids[groups.offsets[e]:groups.offsets[e + 1]]
        assert torch.equal(run, torch.nonzero(flat == e).flatten())
        assert torch.equal(groups.token_ids[groups.offsets[e]:groups.offsets[e + 1]], run // top_k)

    align = align_block_size(ids, experts, block_m, groups)
    used = int(align.num_padded)
    assert used % block_m == 0 and align.sorted_ids.numel() == max_padded_rows(flat.numel(), experts, block_m)
    assert used == sum(-(-int(c) // block_m) * block_m for c in groups.counts)
    real = align.sorted_ids[:used]
    assert torch.equal(torch.sort(real[real < flat.numel()].long()).values, torch.arange(flat.numel()))
    assert (align.sorted_ids[used:] == flat.numel()).all()
    tiles = real.view(-1, block_m)
    for b, tile in enumerate(tiles):  # each tile: one expert's pairs, then padding
        e = int(align.block_experts[b])
        ids_in = tile[tile < flat.numel()].long()
        assert ids_in.numel() > 0 and (flat[ids_in] == e).all()
    assert (align.block_experts[used // block_m:] == -1).all()


# --- the CPU path ---------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(0, 16), hidden=st.sampled_from([8, 32, 40]), inter=st.sampled_from([8, 24]),
       experts=st.integers(1, 8), top_k=st.integers(1, 3), routing=st.sampled_from(ROUTINGS),
       bias=st.booleans(), equal_weights=st.booleans(), activation=st.sampled_from(ACTIVATIONS),
       seed=st.integers(0, 2 ** 31))
def test_cpu_path_matches_reference_in_float32(tokens, hidden, inter, experts, top_k, routing, bias, equal_weights,
                                               activation, seed):
    case = make_case(torch.Generator().manual_seed(seed), tokens, hidden, inter, experts, top_k, routing, bias=bias,
                     equal_weights=equal_weights)
    want = ref(case, activation)
    assert_f32_close(fused_experts_cpu(**case, activation=activation), want)
    packed = pack_experts_cpu(case["w_gate_up"], case["w_down"], case["b_gate_up"], case["b_down"])
    got = fused_experts_cpu(case["x"], None, None, case["topk_ids"], case["topk_weights"], activation,
                            packed=packed)
    assert_f32_close(got, want)


@pytest.mark.parametrize("gemm", ["auto", "avx512", "onednn", "linear"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_cpu_path_in_bfloat16(gen, gemm, activation):
    if gemm == "avx512":
        from kernels.cpu import load

        if load() is None or not load().bf16_gemm_supported():
            pytest.skip("no AVX512-BF16 build of kernels.cpu here")
    for routing, bias, top_k in (("topk", False, 2), ("repeats", True, 3), ("one_expert", True, 1),
                                 ("skip_expert", False, 2)):
        case = make_case(gen, 13, 64, 40, 6, top_k, routing, bias=bias, dtype=torch.bfloat16)
        want = ref(case, activation)
        packed = pack_experts_cpu(case["w_gate_up"], case["w_down"], case["b_gate_up"], case["b_down"], gemm=gemm)
        got = fused_experts_cpu(case["x"], None, None, case["topk_ids"], case["topk_weights"], activation,
                                packed=packed)
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        # Both round each projection to bfloat16 (the CPU path's SiLU once, the reference's twice) and
        # sum in different orders: a few bfloat16 ulps of the output's scale. The float64 product of the
        # same bfloat16 inputs bounds both, so a bug shared by reference and fast path cannot pass.
        scale = want.float().abs().max().item()
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -6, atol=2 ** -6 * scale)
        exact = dense_all_experts(case, activation).float()
        for name, out in (("cpu", got), ("reference", want)):
            err = (out.float() - exact).abs().max().item()
            assert err <= 2 ** -5 * scale, f"{name} vs float64: {err:.3g} > {2 ** -5 * scale:.3g}"


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_grouped_gemm_equals_the_per_expert_calls(gen, monkeypatch, activation):
    """bf16_grouped_gemm (one call per projection for every active expert) gives each row bit for bit what
    one bf16_gemm call per expert gives: experts with no rows, one expert taking every row, biases, and
    more rows than one block of 64."""
    from kernels.cpu import load

    mod = load()
    if mod is None or not mod.bf16_gemm_supported():
        pytest.skip("no AVX512-BF16 build of kernels.cpu here")
    for tokens, routing, bias, top_k in ((13, "topk", False, 2), (9, "repeats", True, 3), (70, "one_expert", True, 1),
                                         (11, "skip_expert", False, 2), (1, "topk", True, 2)):
        case = make_case(gen, tokens, 64, 40, 6, top_k, routing, bias=bias, dtype=torch.bfloat16)
        packed = pack_experts_cpu(case["w_gate_up"], case["w_down"], case["b_gate_up"], case["b_down"], gemm="avx512")
        args = (case["x"], None, None, case["topk_ids"], case["topk_weights"], activation)
        grouped = fused_experts_cpu(*args, packed=packed)
        monkeypatch.setattr(moe_cpu, "_grouped", lambda *_: False)
        per_expert = fused_experts_cpu(*args, packed=packed)
        monkeypatch.undo()
        assert torch.equal(grouped, per_expert), routing
    with pytest.raises(RuntimeError, match="offsets"):
        mod.bf16_grouped_gemm(case["x"], packed.gate_up, torch.tensor([0, 5, 3, 3, 3, 3, 3]), 80, None)


def test_cpu_path_runs_only_active_experts(gen, monkeypatch):
    tokens, experts_n = 12, 8
    case = make_case(gen, tokens, 16, 8, experts_n, 2, "topk")
    case["topk_ids"] = torch.stack([torch.full((tokens,), 3), torch.tensor([1, 5] * (tokens // 2))], dim=1)
    ran, gemms = [], []
    forward, gemm = moe_cpu._expert_forward, moe_cpu._gemm

    def count_forward(experts, e, xs, *args):
        ran.append((e, xs.shape[0]))
        return forward(experts, e, xs, *args)

    def count_gemm(experts, x, *args):
        gemms.append(x.shape[0])
        return gemm(experts, x, *args)

    monkeypatch.setattr(moe_cpu, "_expert_forward", count_forward)
    monkeypatch.setattr(moe_cpu, "_gemm", count_gemm)
    got = fused_experts_cpu(**case)
    # Each active expert once, over all its tokens at once: two GEMMs each, nothing for the other five.
    assert ran == [(1, tokens // 2), (3, tokens), (5, tokens // 2)]
    assert gemms == [tokens // 2, tokens // 2, tokens, tokens, tokens // 2, tokens // 2]
    assert_f32_close(got, ref(case, "silu"))


def test_cpu_path_takes_a_precomputed_grouping(gen):
    case = make_case(gen, 7, 16, 8, 4, 2, "repeats")
    groups = group_by_expert(case["topk_ids"], 4)
    assert_f32_close(fused_experts_cpu(**case, groups=groups, ids_checked=True), ref(case, "silu"))


# --- Triton, through the interpreter ---------------------------------------------------------------


def _triton_fused_experts():
    pytest.importorskip("triton")
    from kernels.triton_fused_moe import fused_experts

    return fused_experts


@pytest.mark.usefixtures("poisoned")
@settings(max_examples=12, deadline=None)
@given(tokens=st.integers(1, 16), experts=st.integers(4, 8), top_k=st.integers(1, 2),
       routing=st.sampled_from(ROUTINGS), bias=st.booleans(), equal_weights=st.booleans(),
       activation=st.sampled_from(ACTIVATIONS), seed=st.integers(0, 2 ** 31))
def test_triton_matches_reference_in_float32(tokens, experts, top_k, routing, bias, equal_weights, activation,
                                             seed):
    fused_experts = _triton_fused_experts()
    case = make_case(torch.Generator().manual_seed(seed), tokens, 32, 32, experts, top_k, routing, bias=bias,
                     equal_weights=equal_weights)
    assert_f32_close(fused_experts(**case, activation=activation), ref(case, activation))


@pytest.mark.usefixtures("poisoned")
@pytest.mark.parametrize("routing,top_k", [("skip_expert", 2), ("one_expert", 2), ("one_expert", 1),
                                           ("repeats", 2)])
def test_triton_edge_routings_and_odd_sizes(gen, routing, top_k):
    fused_experts = _triton_fused_experts()
    # H and I not multiples of the tiles: every k and n edge is masked.
    case = make_case(gen, 16, 40, 24, 4, top_k, routing, bias=True)
    want = ref(case, "gpt_oss_swiglu")
    assert_f32_close(fused_experts(**case, activation="gpt_oss_swiglu"), want)
    align = align_block_size(case["topk_ids"], 4, 32)  # a caller-made grouping with taller tiles
    assert_f32_close(fused_experts(**case, activation="gpt_oss_swiglu", alignment=align, ids_checked=True), want)


def test_triton_entry_point_is_exported_and_empty_batches_work(gen):
    _triton_fused_experts()
    case = make_case(gen, 0, 32, 32, 4, 2, "topk")
    out = kernels.fused_experts(**case)
    assert out.shape == (0, 32)
    with pytest.raises(ValueError, match="block_m"):
        case = make_case(gen, 3, 32, 32, 4, 2, "topk")
        kernels.fused_experts(**case, alignment=align_block_size(case["topk_ids"], 4, 8))


@pytest.mark.parametrize("forced", [None, "onednn", "avx512", "auto"])
@pytest.mark.parametrize("amx", [None, "0"])
def test_expert_gemm_choice_is_the_dense_linears(monkeypatch, forced, amx):
    # kernels.cpu keeps a copy of services/engine/linear.py's rule (kernels may not import services):
    # the two must agree, or MoE experts and dense layers would multiply differently.
    from kernels.cpu import bf16_gemm_choice
    from services.engine.linear import cpu_gemm_choice

    for name, value in (("PAGEDSERVE_CPU_GEMM", forced), ("PAGEDSERVE_CPU_AMX", amx)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert bf16_gemm_choice() == cpu_gemm_choice()
