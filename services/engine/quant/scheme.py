"""Which `quantization_config`s the engine serves, read into a `QuantScheme`; anything else is refused.

A checkpoint's `quantization_config` changes the math of every layer it covers, so each field is either
read (and its value checked against what the readers in `formats/` implement), known not to change the
math (calibration settings, kernel hints), or refused at load with `QuantizationConfigError`, which names
the method and the field. A field this module does not know is accepted only at a neutral value (null,
false, an empty list or mapping): a future field that is switched on is never silently ignored.

Served, as vLLM spells the methods:
- `fp8`: float8_e4m3fn weights, per-tensor `weight_scale` or block-wise `weight_scale_inv`
  (`weight_block_size`); activations quantized per token (dynamic), per 1 x block group (block-wise,
  dynamic) or per tensor (`static`, `input_scale`).
- `compressed-tensors`: `float-quantized` (FP8, tensor/channel/block scales), `int-quantized` and
  `naive-quantized` (INT8, W8A8 with int8 activations, or weight-only), `pack-quantized` (4- or 8-bit
  integers packed in int32, group/channel scales, symmetric or with packed zero points, `actorder`).
- `gptq`: 4 and 8 bits, any group size, `desc_act` (`g_idx`), symmetric or asymmetric, both checkpoint
  formats (`gptq`: stored zero point = zero - 1, as AutoGPTQ wrote it; `gptq_v2`: stored as is).
- `awq`: 4 bits, `version: gemm` (AutoAWQ's GEMM packing order), zero points.
- `mxfp4`: gpt-oss's experts as `*_blocks` (e2m1 codes) and `*_scales` (E8M0 exponents per 32 inputs);
  as in transformers, only the expert layers are quantized and every other linear is read as stored
  (services/engine/quant/formats/mxfp4.py).
GGUF files carry their types per tensor and need no config (services/engine/quant/formats/gguf_tensors.py).
No torch here: the launcher checks a model before it starts any process.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field


class QuantizationConfigError(ValueError):
    """A `quantization_config` (or one of its fields) this engine does not serve."""

    def __init__(self, method: str, field_name: str, why: str):
        self.method, self.field = method, field_name
        super().__init__(f"quantization_config: method {method!r}, field {field_name!r}: {why}")


@dataclass(frozen=True)
class ActivationQuant:
    """How a layer's input is quantized before the product (W8A8 checkpoints)."""

    dtype: str  # "fp8" (e4m3) | "int8" (symmetric)
    dynamic: bool  # scales computed per call; else the checkpoint's `input_scale`
    granularity: str  # "token" | "tensor" | "group" (1 x group_size along the input, dynamic only)
    group_size: int | None = None


@dataclass(frozen=True)
class WeightQuant:
    """How one linear layer's weight is stored."""

    layout: str  # "fp8" | "gptq" | "awq" | "ct-fp8" | "ct-int8" | "ct-packed"
    bits: int
    group_size: int | None = None  # input columns per scale; None: per output row, tensor or block
    block: tuple[int, int] | None = None  # FP8 block-wise scales: (output rows, input columns) per scale
    symmetric: bool = True
    act_order: bool = False  # a `g_idx` maps input columns to groups
    zero_offset: int = 0  # GPTQ v1: the real zero point is the stored one plus this


@dataclass(frozen=True)
class LinearScheme:
    weight: WeightQuant
    activation: ActivationQuant | None = None


@dataclass(frozen=True)
class QuantScheme:
    method: str
    groups: tuple[tuple[tuple[str, ...], LinearScheme], ...]  # (targets, scheme); the first match wins
    ignore: tuple[str, ...] = ()
    substring_ignore: bool = False  # fp8/awq: a module is skipped when a listed name occurs in its name
    kv_cache_scales: bool = False  # the checkpoint carries per-layer k_scale / v_scale for an FP8 KV cache
    notes: tuple[str, ...] = field(default=())

    def for_module(self, name: str) -> LinearScheme | None:
        """The scheme of the linear layer `name` (e.g. "model.layers.0.self_attn.q_proj"), None when the
        checkpoint keeps it unquantized."""
        if any(_matches(p, name, self.substring_ignore) for p in self.ignore):
            return None
        for targets, scheme in self.groups:
            if any(t == "Linear" or _matches(t, name, False) for t in targets):
                return scheme
        return None

    def describe(self) -> str:
        if self.method == "mxfp4":
            return "mxfp4 (experts, e2m1 with E8M0 scales per 32)"
        kinds = sorted({f"{s.weight.layout} {s.weight.bits}-bit" for _, s in self.groups})
        return f"{self.method} ({', '.join(kinds)})"


def _matches(pattern: str, name: str, substring: bool) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    if substring:
        return pattern in name
    return name == pattern or name.endswith("." + pattern)


_NEUTRAL = (None, False, "", [], {}, ())


def _check_fields(method: str, cfg: dict, read: set[str], benign: set[str], where: str = "") -> None:
    if not isinstance(cfg, dict):
        raise QuantizationConfigError(method, where or "quantization_config",
                                      f"expected a mapping, got {type(cfg).__name__}")
    for key, value in cfg.items():
        if key in read or key in benign:
            continue
        if value in _NEUTRAL:
            continue
        raise QuantizationConfigError(method, f"{where}.{key}" if where else key,
                                      f"unknown field set to {value!r}; this engine does not "
                                      "read it and will not guess what it changes")


def _get(method: str, cfg: dict, key: str, allowed, default=None):
    value = cfg.get(key, default)
    if value not in allowed:
        raise QuantizationConfigError(method, key, f"{value!r} is not served; served: "
                                                   f"{', '.join(map(repr, allowed))}")
    return value


def _int(method: str, cfg: dict, key: str, default=None) -> int:
    value = cfg.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise QuantizationConfigError(method, key, f"expected an integer, got {value!r}")
    return value


def _names(method: str, cfg: dict, key: str) -> tuple[str, ...]:
    value = cfg.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise QuantizationConfigError(method, key, f"expected a list of module names, got {value!r}")
    return tuple(value)


def _fp8(cfg: dict) -> QuantScheme:
    m = "fp8"
    _check_fields(m, cfg, {"quant_method", "activation_scheme", "weight_block_size", "fmt", "ignored_layers",
                           "modules_to_not_convert"}, {"dequantize"})
    _get(m, cfg, "fmt", ("e4m3",), "e4m3")
    scheme = _get(m, cfg, "activation_scheme", ("dynamic", "static"), "dynamic")
    block = cfg.get("weight_block_size")
    if block is not None:
        if (not isinstance(block, list) or len(block) != 2
                or not all(isinstance(b, int) and b > 0 for b in block)):
            raise QuantizationConfigError(m, "weight_block_size", f"expected [rows, columns], got {block!r}")
        if scheme != "dynamic":
            raise QuantizationConfigError(m, "activation_scheme", "block-wise FP8 weights quantize activations "
                                                                  "dynamically; 'static' is not served with them")
        act = ActivationQuant("fp8", True, "group", block[1])
        weight = WeightQuant("fp8", 8, block=(block[0], block[1]))
    else:
        act = ActivationQuant("fp8", scheme == "dynamic", "token" if scheme == "dynamic" else "tensor")
        weight = WeightQuant("fp8", 8)
    ignore = _names(m, cfg, "ignored_layers") + _names(m, cfg, "modules_to_not_convert")
    return QuantScheme(m, ((("Linear",), LinearScheme(weight, act)),), ignore, substring_ignore=True)


_GPTQ_BENIGN = {"damp_percent", "damp_auto_increment", "true_sequential", "static_groups", "model_name_or_path",
                "model_file_base_name", "tokenizer", "dataset", "use_exllama", "exllama_config", "max_input_length",
                "use_cuda_fp16", "cache_block_outputs", "batch_size", "module_name_preceding_first_block",
                "modules_in_block_to_quantize", "meta", "mse", "backend", "use_marlin", "quantizer", "format",
                "pack_dtype", "block_name_to_quantize", "inside_layer_modules", "v2", "hyb_act", "act_group_aware",
                "quant_method", "true_sequential_pre_layer", "offload_to_disk", "offload_to_disk_path",
                "sym_quant", "desc_act_pre", "rotation", "is_marlin_format", "adapter", "damp"}


def _gptq(cfg: dict) -> QuantScheme:
    m = "gptq"
    _check_fields(m, cfg, {"bits", "group_size", "desc_act", "sym", "checkpoint_format", "lm_head", "dynamic"},
                  _GPTQ_BENIGN)
    bits = _get(m, cfg, "bits", (4, 8))
    group = _int(m, cfg, "group_size", -1)
    if group != -1 and (group < 2 or group % 2):
        raise QuantizationConfigError(m, "group_size", f"{group} is not served (an even size >= 2, or -1)")
    fmt = _get(m, cfg, "checkpoint_format", ("gptq", "gptq_v2"), cfg.get("checkpoint_format") or "gptq")
    if cfg.get("pack_dtype") not in (None, "int32"):
        raise QuantizationConfigError(m, "pack_dtype", f"{cfg['pack_dtype']!r}: only int32 packing is read")
    if cfg.get("format") not in (None, "gptq", "gptq_v2"):
        raise QuantizationConfigError(m, "format", f"{cfg['format']!r}: only the gptq packing is read")
    if cfg.get("lm_head"):
        raise QuantizationConfigError(m, "lm_head", "a quantized LM head is not read (only decoder layers)")
    if cfg.get("dynamic"):
        raise QuantizationConfigError(m, "dynamic", "per-module overrides of bits or group size are not read")
    weight = WeightQuant("gptq", bits, None if group == -1 else group, symmetric=bool(cfg.get("sym", True)),
                         act_order=bool(cfg.get("desc_act", False)), zero_offset=1 if fmt == "gptq" else 0)
    return QuantScheme(m, ((("Linear",), LinearScheme(weight)),), ("lm_head",))


def _awq(cfg: dict) -> QuantScheme:
    m = "awq"
    _check_fields(m, cfg, {"bits", "w_bit", "group_size", "q_group_size", "zero_point", "version",
                           "modules_to_not_convert"},
                  {"quant_method", "backend", "do_fuse", "fuse_max_seq_len", "exllama_config", "modules_to_fuse"})
    bits = _get(m, {"bits": cfg.get("bits", cfg.get("w_bit"))}, "bits", (4,))
    group = _int(m, {"group_size": cfg.get("group_size", cfg.get("q_group_size"))}, "group_size")
    if group != -1 and (group < 2 or group % 2):
        raise QuantizationConfigError(m, "group_size", f"{group} is not served (an even size >= 2, or -1)")
    _get(m, {"version": str(cfg.get("version", "gemm")).lower()}, "version", ("gemm",))
    _get(m, cfg, "zero_point", (True,), True)
    weight = WeightQuant("awq", bits, None if group == -1 else group, symmetric=False)
    return QuantScheme(m, ((("Linear",), LinearScheme(weight)),), _names(m, cfg, "modules_to_not_convert") or
                       ("lm_head",), substring_ignore=True)


_CT_ARGS_READ = {"num_bits", "type", "symmetric", "group_size", "strategy", "dynamic", "actorder", "block_structure"}
_CT_ARGS_BENIGN = {"observer", "observer_kwargs", "scale_dtype", "zp_dtype"}


def _ct_weights(m: str, fmt: str, args: dict) -> WeightQuant:
    where = "weights"
    _check_fields(m, args, _CT_ARGS_READ, _CT_ARGS_BENIGN, where)
    kind = _get(m, args, "type", ("int", "float"), "int")
    bits = _int(m, args, "num_bits", 8)
    strategy = args.get("strategy") or "tensor"
    sym = bool(args.get("symmetric", True))
    if args.get("dynamic"):
        raise QuantizationConfigError(m, f"{where}.dynamic", "dynamically quantized weights are not read")
    actorder = args.get("actorder")
    if actorder not in (None, "group", "weight", "static"):
        raise QuantizationConfigError(m, f"{where}.actorder", f"{actorder!r} is not read")
    if kind == "float":
        if bits != 8 or fmt not in ("float-quantized", "naive-quantized"):
            raise QuantizationConfigError(m, f"{where}.num_bits", f"{bits}-bit float weights in format {fmt!r} "
                                                                  "are not read (8-bit float-quantized is)")
        if strategy not in ("tensor", "channel", "block"):
            raise QuantizationConfigError(m, f"{where}.strategy", f"{strategy!r} for FP8 weights is not read")
        if not sym:
            raise QuantizationConfigError(m, f"{where}.symmetric", "asymmetric FP8 weights are not read")
        block = None
        if strategy == "block":
            bs = args.get("block_structure")
            if not (isinstance(bs, list) and len(bs) == 2 and all(isinstance(b, int) and b > 0 for b in bs)):
                raise QuantizationConfigError(m, f"{where}.block_structure", f"expected [rows, columns], got {bs!r}")
            block = (bs[0], bs[1])
        return WeightQuant("ct-fp8", 8, block=block, group_size=None)
    group = args.get("group_size")
    if strategy == "group":
        if not isinstance(group, int) or group < 2 or group % 2:
            raise QuantizationConfigError(m, f"{where}.group_size", f"{group!r} is not served (an even size >= 2)")
    elif strategy in ("channel", "tensor"):
        group = None
    else:
        raise QuantizationConfigError(m, f"{where}.strategy", f"{strategy!r} for integer weights is not read")
    if fmt == "pack-quantized":
        if bits not in (4, 8):
            raise QuantizationConfigError(m, f"{where}.num_bits", f"{bits}-bit packed weights are not read (4, 8)")
        if strategy == "tensor":
            raise QuantizationConfigError(m, f"{where}.strategy", "per-tensor packed weights are not read")
        return WeightQuant("ct-packed", bits, group, symmetric=sym, act_order=actorder in ("group", "weight"))
    if fmt in ("int-quantized", "naive-quantized"):
        if bits != 8:
            raise QuantizationConfigError(m, f"{where}.num_bits", f"{bits}-bit unpacked integer weights are "
                                                                  "not read (8)")
        return WeightQuant("ct-int8", 8, group, symmetric=sym, act_order=actorder in ("group", "weight"))
    raise QuantizationConfigError(m, "format", f"{fmt!r} with integer weights is not read")


def _ct_activations(m: str, args: dict | None) -> ActivationQuant | None:
    if not args:
        return None
    where = "input_activations"
    _check_fields(m, args, _CT_ARGS_READ, _CT_ARGS_BENIGN, where)
    kind = _get(m, args, "type", ("int", "float"), "int")
    if _int(m, args, "num_bits", 8) != 8:
        raise QuantizationConfigError(m, f"{where}.num_bits", f"{args['num_bits']}-bit activations are not served")
    if not args.get("symmetric", True):
        raise QuantizationConfigError(m, f"{where}.symmetric", "asymmetric activations are not served")
    strategy = args.get("strategy") or "tensor"
    dynamic = args.get("dynamic", False)
    if dynamic not in (True, False):
        raise QuantizationConfigError(m, f"{where}.dynamic", f"{dynamic!r} is not served (true or false)")
    if strategy == "token" and dynamic:
        return ActivationQuant("fp8" if kind == "float" else "int8", True, "token")
    if strategy == "tensor":
        return ActivationQuant("fp8" if kind == "float" else "int8", bool(dynamic), "tensor")
    if strategy == "group" and dynamic and isinstance(args.get("group_size"), int):
        return ActivationQuant("fp8" if kind == "float" else "int8", True, "group", args["group_size"])
    raise QuantizationConfigError(m, f"{where}.strategy", f"{strategy!r} (dynamic={dynamic}) is not served")


def _within(m: str, where: str, part: str, read, *args):
    """`read(m, *args)`, its refusals' field names prefixed with where they sit in the config."""
    try:
        return read(m, *args)
    except QuantizationConfigError as e:
        name = e.field if e.field.startswith(part) or e.field == "format" else f"{part}.{e.field}"
        raise QuantizationConfigError(m, f"{where}.{name}", str(e).split(": ", 3)[-1]) from None


def _compressed_tensors(cfg: dict) -> QuantScheme:
    m = "compressed-tensors"
    _check_fields(m, cfg, {"format", "config_groups", "ignore", "kv_cache_scheme", "quantization_status",
                           "sparsity_config", "transform_config"},
                  {"quant_method", "global_compression_ratio", "version", "provider"})
    if cfg.get("sparsity_config"):
        raise QuantizationConfigError(m, "sparsity_config", "sparse (e.g. 2:4) checkpoints are not read")
    if cfg.get("transform_config"):
        raise QuantizationConfigError(m, "transform_config", "rotated/transformed weights are not read")
    status = cfg.get("quantization_status", "compressed")
    if status not in ("compressed", "frozen"):
        raise QuantizationConfigError(m, "quantization_status", f"{status!r}: only compressed checkpoints are read")
    fmt = cfg.get("format") or "dense"
    groups = []
    raw_groups = cfg.get("config_groups") or {}
    if not isinstance(raw_groups, dict):
        raise QuantizationConfigError(m, "config_groups", f"expected a mapping, got {type(raw_groups).__name__}")
    if not raw_groups:
        raise QuantizationConfigError(m, "config_groups", "no quantization group: nothing to read")
    for gname, g in raw_groups.items():
        where = f"config_groups.{gname}"
        if not isinstance(g, dict):
            raise QuantizationConfigError(m, where, f"expected a mapping, got {g!r}")
        _check_fields(m, g, {"targets", "weights", "input_activations", "output_activations", "format"}, set())
        if g.get("output_activations"):
            raise QuantizationConfigError(m, f"{where}.output_activations", "quantized outputs are not served")
        gfmt = g.get("format") or fmt
        if gfmt not in ("float-quantized", "int-quantized", "naive-quantized", "pack-quantized"):
            raise QuantizationConfigError(m, f"{where}.format", f"{gfmt!r} is not read; read: float-quantized, "
                                                                "int-quantized, naive-quantized, pack-quantized")
        if not g.get("weights"):
            raise QuantizationConfigError(m, f"{where}.weights", "activation-only quantization is not served")
        weight = _within(m, where, "weights", _ct_weights, gfmt, g["weights"])
        act = _within(m, where, "input_activations", _ct_activations, g.get("input_activations"))
        if act is not None and weight.layout == "ct-packed":
            raise QuantizationConfigError(m, f"{where}.input_activations", "packed weights with quantized "
                                                                           "activations are not served")
        targets = g.get("targets") or []
        if not isinstance(targets, list) or not targets:
            raise QuantizationConfigError(m, f"{where}.targets", f"expected a list of targets, got {targets!r}")
        groups.append((tuple(targets), LinearScheme(weight, act)))
    kv = cfg.get("kv_cache_scheme")
    if kv:
        if not isinstance(kv, dict) or not (kv.get("type") == "float" and kv.get("num_bits") == 8
                                            and kv.get("strategy", "tensor") == "tensor" and not kv.get("dynamic")):
            raise QuantizationConfigError(m, "kv_cache_scheme", f"{kv!r}: only per-tensor static FP8 KV scales "
                                                                "are read")
    return QuantScheme(m, tuple(groups), _names(m, cfg, "ignore"), kv_cache_scales=bool(kv))


def _mxfp4(cfg: dict) -> QuantScheme:
    """No linear-layer groups: the method quantizes expert layers only (which ones hold MXFP4 the tensors
    say: `experts.*_blocks`); `modules_to_not_convert` names what transformers leaves alone, the rest."""
    m = "mxfp4"
    _check_fields(m, cfg, {"quant_method", "modules_to_not_convert"}, {"dequantize"})
    return QuantScheme(m, (), _names(m, cfg, "modules_to_not_convert"))


_READERS = {"fp8": _fp8, "gptq": _gptq, "awq": _awq, "compressed-tensors": _compressed_tensors, "mxfp4": _mxfp4}
_WHY_NOT = {
    "bitsandbytes": "bitsandbytes NF4/int8 is not read",
}


def parse_quantization(hf_config: dict) -> QuantScheme | None:
    """The scheme of a Hugging Face config's `quantization_config` (None for a plain checkpoint); raises
    QuantizationConfigError naming the method and field for anything not served."""
    cfg = hf_config.get("quantization_config") or hf_config.get("compression_config")
    if not cfg:
        return None
    if not isinstance(cfg, dict):
        raise QuantizationConfigError("?", "quantization_config", f"expected a mapping, got {type(cfg).__name__}")
    method = str(cfg.get("quant_method") or ("compressed-tensors" if "config_groups" in cfg else "")).lower()
    method = method.replace("_", "-") if method == "compressed_tensors" else method
    if method not in _READERS:
        why = _WHY_NOT.get(method, f"not a served method; served: {', '.join(sorted(_READERS))} (and GGUF files)")
        raise QuantizationConfigError(method or "?", "quant_method", why)
    return _READERS[method](cfg)


def check_requested(scheme: QuantScheme | None, requested: str | None, is_gguf: bool) -> None:
    """`--quantization` names what the checkpoint must be (vLLM's rule: a mismatch is an error)."""
    if requested in (None, "", "auto", "none"):
        return
    found = "gguf" if is_gguf else (scheme.method if scheme is not None else None)
    if requested != found:
        raise QuantizationConfigError(requested, "quantization", f"--quantization {requested} was asked for, but the "
                                                                 f"model is {found or 'not quantized'}")
