"""Small quantized checkpoints written here in each format's exact on-disk layout, from a float model.

Each writer quantizes every decoder projection of a Hugging Face float32 checkpoint (round to nearest, the
groups of the format), writes the format's tensors and `quantization_config` into `out`, and writes the
dequantized weights, computed here from the codes it chose (not read back), as a plain float32 checkpoint
into `ref`, which transformers runs as the reference. Layouts follow the formats' own writers: GPTQ's
packing along the input with zero - 1 stored (v1), AWQ's 0 2 4 6 1 3 5 7 order, compressed-tensors'
pack_to_int32 (unsigned = signed + 2^(bits-1), zero points packed along the output), gpt-oss's MXFP4
blocks and scales (transformers' Mxfp4 layout).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from services.engine.quant.formats import mxfp4
from services.engine.quant.formats.int_packing import pack_awq, pack_int32

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")


def quantize_groups(w: torch.Tensor, bits: int, group: int, sym: bool, min_zero: int = 0):
    """(codes u8 [N, K], scale f16 [N, G], zero u8 [N, G]) with w ~ (codes - zero) * scale."""
    n, k = w.shape
    groups = -(-k // group)
    pad = groups * group - k
    g = torch.nn.functional.pad(w, (0, pad)).view(n, groups, group)
    top = (1 << bits) - 1
    if sym:
        half = 1 << (bits - 1)
        scale = (g.abs().amax(-1) / (half - 1)).clamp_min(1e-6).half()
        zero = torch.full((n, groups), half, dtype=torch.int64)
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = ((hi - lo) / top).clamp_min(1e-6).half()
        zero = torch.round(-lo / scale.float()).long().clamp(min_zero, top)
    codes = torch.round(g / scale.float()[..., None]) + zero[..., None]
    codes = codes.clamp(0, top).reshape(n, -1)[:, :k].to(torch.uint8)
    return codes, scale, zero.to(torch.uint8)


def dequant(codes, scale, zero, group):
    gi = torch.arange(codes.shape[1]) // group
    return (codes.float() - zero.float()[:, gi]) * scale.float()[:, gi]


def _start(src: Path, out: Path, ref: Path) -> tuple[dict, dict]:
    for d in (out, ref):
        shutil.copytree(src, d, dirs_exist_ok=True)
        for f in d.glob("*.safetensors"):
            f.unlink()
    return load_file(str(next(src.glob("*.safetensors")))), json.loads((src / "config.json").read_text())


def _finish(out: Path, ref: Path, tensors: dict, ref_tensors: dict, cfg: dict, qcfg: dict) -> None:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    save_file({k: v.contiguous() for k, v in ref_tensors.items()}, str(ref / "model.safetensors"),
              metadata={"format": "pt"})
    (ref / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "config.json").write_text(json.dumps({**cfg, "quantization_config": qcfg}, indent=2))


def _modules(state: dict):
    for name in list(state):
        if name.endswith(".weight") and any(p in name for p in PROJECTIONS):
            yield name[:-len(".weight")]


def write_gptq(src, out, ref, bits=4, group=32, sym=True, desc_act=False, v2=False, seed=0):
    state, cfg = _start(src, out, ref)
    tensors, refs = dict(state), dict(state)
    gen = torch.Generator().manual_seed(seed)
    for m in _modules(state):
        w = tensors.pop(m + ".weight")
        n, k = w.shape
        gs = group if group > 0 else k
        if desc_act:  # columns assigned to groups in a random order, each group gs columns (GPTQ's act-order)
            order = torch.randperm(k, generator=gen)
            g_idx = torch.empty(k, dtype=torch.int32)
            g_idx[order] = (torch.arange(k) // gs).int()
        else:
            g_idx = (torch.arange(k) // gs).int()
        perm = torch.sort(g_idx.long(), stable=True).indices
        codes_s, scale, zero = quantize_groups(w[:, perm], bits, gs, sym, min_zero=0 if v2 else 1)
        codes = torch.empty_like(codes_s)
        codes[:, perm] = codes_s
        deq = torch.empty(n, k)
        deq[:, perm] = dequant(codes_s, scale, zero, gs)
        refs[m + ".weight"] = deq
        stored_zero = zero.int() - (0 if v2 else 1)
        tensors[m + ".qweight"] = pack_int32(codes.T, bits, 0)
        tensors[m + ".qzeros"] = pack_int32(stored_zero.T, bits, 1)
        tensors[m + ".scales"] = scale.T.contiguous()
        tensors[m + ".g_idx"] = g_idx
    qcfg = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": sym,
            "damp_percent": 0.01, "true_sequential": True, "static_groups": False,
            "checkpoint_format": "gptq_v2" if v2 else "gptq"}
    _finish(out, ref, tensors, refs, cfg, qcfg)


def write_awq(src, out, ref, group=32):
    state, cfg = _start(src, out, ref)
    tensors, refs = dict(state), dict(state)
    for m in _modules(state):
        w = tensors.pop(m + ".weight")
        codes, scale, zero = quantize_groups(w, 4, group, sym=False)
        refs[m + ".weight"] = dequant(codes, scale, zero, group)
        tensors[m + ".qweight"] = pack_awq(codes.T.contiguous())
        tensors[m + ".qzeros"] = pack_awq(zero.T.contiguous())
        tensors[m + ".scales"] = scale.T.contiguous()
    qcfg = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    _finish(out, ref, tensors, refs, cfg, qcfg)


def write_ct_packed(src, out, ref, bits=4, group=32, sym=True, actorder=False, seed=0):
    state, cfg = _start(src, out, ref)
    tensors, refs = dict(state), dict(state)
    gen = torch.Generator().manual_seed(seed)
    for m in _modules(state):
        w = tensors.pop(m + ".weight")
        n, k = w.shape
        g_idx = (torch.arange(k) // group).int()
        if actorder:
            g_idx = g_idx[torch.randperm(k, generator=gen)]
        perm = torch.sort(g_idx.long(), stable=True).indices
        codes_s, scale, zero = quantize_groups(w[:, perm], bits, group, sym)
        scale = scale.to(torch.bfloat16)  # llm-compressor's scales follow the model's dtype
        codes = torch.empty_like(codes_s)
        codes[:, perm] = codes_s
        deq = torch.empty(n, k)
        deq[:, perm] = dequant(codes_s, scale, zero, group)
        refs[m + ".weight"] = deq
        # pack_to_int32 stores signed + 2^(bits-1): for these unsigned codes that is the code itself
        tensors[m + ".weight_packed"] = pack_int32(codes, bits, 1)
        tensors[m + ".weight_scale"] = scale
        tensors[m + ".weight_shape"] = torch.tensor([n, k])
        if not sym:
            tensors[m + ".weight_zero_point"] = pack_int32(zero, bits, 0)
        if actorder:
            tensors[m + ".weight_g_idx"] = g_idx
    fmt = "pack-quantized"
    weights = {"num_bits": bits, "type": "int", "symmetric": sym, "strategy": "group", "group_size": group,
               "dynamic": False, "actorder": "group" if actorder else None, "observer": "minmax"}
    _finish(out, ref, tensors, refs, cfg, _ct_config(fmt, weights, None))


def _ct_config(fmt, weights, acts):
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "ignore": ["lm_head"], "global_compression_ratio": None,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                          "output_activations": None}}}


def write_ct_int8(src, out, ref, act_dynamic=True):
    """INT8 W8A8: per-channel symmetric int8 weights, int8 activations per token (dynamic)."""
    state, cfg = _start(src, out, ref)
    tensors, refs = dict(state), dict(state)
    for m in _modules(state):
        w = tensors.pop(m + ".weight")
        scale = (w.abs().amax(1, keepdim=True) / 127).clamp_min(1e-6)
        q = torch.round(w / scale).clamp(-128, 127).to(torch.int8)
        refs[m + ".weight"] = q.float() * scale
        tensors[m + ".weight"] = q
        tensors[m + ".weight_scale"] = scale
    weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}
    acts = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    _finish(out, ref, tensors, refs, cfg, _ct_config("int-quantized", weights, acts))
    return {"dtype": "int8", "granularity": "token"}


def fp8_quantize(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn)


def write_fp8(src, out, ref, block=(32, 32)):
    """`fp8` with `weight_block_size` (block scales in weight_scale_inv), or per tensor (block None)."""
    state, cfg = _start(src, out, ref)
    tensors, refs = dict(state), dict(state)
    for m in _modules(state):
        w = tensors.pop(m + ".weight")
        n, k = w.shape
        if block is None:
            scale = (w.abs().amax() / 448).reshape(())
            q = fp8_quantize(w, scale)
            refs[m + ".weight"] = q.float() * scale
            tensors[m + ".weight_scale"] = scale.float()
        else:
            bn, bk = block
            nb, kb = -(-n // bn), -(-k // bk)
            padded = torch.nn.functional.pad(w, (0, kb * bk - k, 0, nb * bn - n)).view(nb, bn, kb, bk)
            scale = (padded.abs().amax(dim=(1, 3)) / 448).clamp_min(1e-8)  # [nb, kb]
            full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
            q = fp8_quantize(w, full)
            refs[m + ".weight"] = q.float() * full
            tensors[m + ".weight_scale_inv"] = scale.float()
        tensors[m + ".weight"] = q
    qcfg = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3"}
    if block is not None:
        qcfg["weight_block_size"] = list(block)
    _finish(out, ref, tensors, refs, cfg, qcfg)
    return {"dtype": "fp8", "granularity": "group" if block else "token", "group": block[1] if block else None}


def write_ct_fp8(src, out, ref, strategy="channel", static=False):
    """compressed-tensors float-quantized: FP8 weights per channel or tensor; activations per token
    (dynamic) or per tensor from input_scale (static)."""
    state, cfg = _start(src, out, ref)
    tensors, refs = dict(state), dict(state)
    for m in _modules(state):
        w = tensors.pop(m + ".weight")
        if strategy == "channel":
            scale = w.abs().amax(1, keepdim=True) / 448
        else:
            scale = (w.abs().amax() / 448).reshape(1)
        q = fp8_quantize(w, scale)
        refs[m + ".weight"] = q.float() * scale
        tensors[m + ".weight"] = q
        tensors[m + ".weight_scale"] = scale.float()
        if static:
            tensors[m + ".input_scale"] = torch.tensor([0.02])
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": False}
    acts = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor" if static else "token",
            "dynamic": not static}
    _finish(out, ref, tensors, refs, cfg, _ct_config("float-quantized", weights, acts))
    return {"dtype": "fp8", "granularity": "tensor" if static else "token", "static_scale": 0.02 if static else None}


MXFP4_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def write_mxfp4(src, out, ref):
    """gpt-oss's experts as its MXFP4 checkpoints store them: `experts.gate_up_proj` [E, H, 2I] becomes
    `gate_up_proj_blocks` [E, 2I, H/32, 16] and `gate_up_proj_scales` [E, 2I, H/32] (outputs first, the
    transpose transformers' dequantizer undoes), the same for down; everything else stays as it is, as
    `modules_to_not_convert` says."""
    state, cfg = _start(src, out, ref)
    tensors, refs = dict(state), dict(state)
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = mxfp4.encode(state[name].transpose(1, 2))
        del tensors[name]
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        refs[name] = mxfp4.decode(blocks, scales).transpose(1, 2).contiguous()
    _finish(out, ref, tensors, refs, cfg, {"quant_method": "mxfp4", "modules_to_not_convert": MXFP4_NOT_CONVERTED})
