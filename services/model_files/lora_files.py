"""PEFT LoRA adapter files on disk: where they may be read from, what they must hold, and their identity.

An adapter is a directory holding `adapter_config.json` and `adapter_model.safetensors`, nothing
pickled (`adapter_model.bin` is refused: unpickling runs code). It must lie inside the allowed
directory once every symlink is resolved. Its identity is `digest`, sha256 over the two files' bytes in
a fixed order: the root of its requests' block-hash chains (services/contracts/block_hash.py `adapter_seed`), so
the same name over new weights, or two names over the same files, can never share a wrong block.

Torch-free: the replica checks an adapter here before its engine loads it, and the engine checks the
very bytes it loads with the same function (`read_adapter`), so what was checked is what runs.
Every refusal is an `AdapterError` naming the field (or file) at fault: a 400 over HTTP.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth", "adapter_model.ckpt")
# The Llama family's projections, PEFT's names; the attention ones then the MLP ones.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEFAULT_MAX_BYTES = 1 << 30
# Router -> replica: the digest of the adapter a request names, as the router resolved it from the registry.
# The replica serves only those weights under that name, loading them on demand from its --lora-dir.
DIGEST_HEADER = "x-pagedserve-lora-digest"
# A replica's error code for "this adapter cannot be served here" (missing, other weights, no room): the
# router tries the next replica instead of relaying it.
UNAVAILABLE_CODE = "lora_unavailable"
MAX_CONFIG_BYTES = 1 << 20
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d{1,6})\."
                  r"(?:self_attn\.([qkvo]_proj)|mlp\.((?:gate|up|down)_proj))\.lora_([AB])\.weight$")
_DTYPES = {"F32", "F16", "BF16"}


class AdapterError(ValueError):
    """An adapter that cannot be served; `field` names what is wrong (a config key, a file, a tensor)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class TensorInfo:
    layer: int
    module: str  # one of TARGET_MODULES
    kind: str  # "A" (rank x in) or "B" (out x rank)
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class AdapterFiles:
    """A checked adapter: its bytes, identity and what its tensors are (their values not yet read)."""

    path: str  # the resolved directory
    digest: str  # sha256 hex over config then weights bytes
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]
    tensors: dict[str, TensorInfo]  # safetensors key -> what it is
    weights: bytes = field(repr=False)  # adapter_model.safetensors, as hashed

    @property
    def scale(self) -> float:
        """PEFT's scaling: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.alpha / (self.rank ** 0.5 if self.use_rslora else self.rank)


def resolve_within(path: str, allowed_dir: str | None) -> Path:
    """`path` with every symlink resolved, refused unless it lies inside `allowed_dir` (resolved too).
    No allowed directory: no path is accepted (adapters are then only what the operator gave at start)."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise AdapterError("lora_path", "must be a non-empty path")
    if not allowed_dir:
        raise AdapterError("lora_path", "loading adapters at run time is off: start with --lora-dir")
    root = Path(os.path.realpath(allowed_dir))
    real = Path(os.path.realpath(path if os.path.isabs(path) else os.path.join(root, path)))
    if real != root and root not in real.parents:
        raise AdapterError("lora_path", f"{path!r} is outside the allowed adapter directory")
    return real


def _read(directory: Path, name: str, limit: int) -> bytes:
    f = directory / name
    real = Path(os.path.realpath(f))
    if real.parent != directory:  # a symlinked file pointing elsewhere
        raise AdapterError(name, "is a link out of the adapter directory")
    if not real.is_file():
        raise AdapterError(name, "is missing")
    size = real.stat().st_size
    if size > limit:
        raise AdapterError(name, f"is {size} bytes, over the limit of {limit}")
    data = real.read_bytes()
    if len(data) > limit:
        raise AdapterError(name, f"is over the limit of {limit} bytes")
    return data


def _adapter_directory(path: str, allowed_dir: str | None) -> Path:
    directory = resolve_within(path, allowed_dir)
    if not directory.is_dir():
        raise AdapterError("lora_path", f"{path!r} is not a directory")
    if not (directory / WEIGHTS_FILE).exists():
        pickled = [p for p in PICKLE_FILES if (directory / p).exists()]
        if pickled:
            raise AdapterError(pickled[0], f"pickle files are refused (they run code when loaded): save the adapter "
                               f"as {WEIGHTS_FILE}")
    return directory


def read_adapter(path: str, allowed_dir: str | None, max_rank: int, max_bytes: int = DEFAULT_MAX_BYTES) -> AdapterFiles:
    """Read and check the adapter at `path` (inside `allowed_dir`); raises AdapterError naming the fault."""
    directory = _adapter_directory(path, allowed_dir)
    config_bytes = _read(directory, CONFIG_FILE, MAX_CONFIG_BYTES)
    weights = _read(directory, WEIGHTS_FILE, max_bytes)
    rank, alpha, rslora, targets = _check_config(config_bytes, max_rank)
    tensors = _check_weights(weights, rank, targets)
    digest = hashlib.sha256()
    for name, data in ((CONFIG_FILE, config_bytes), (WEIGHTS_FILE, weights)):
        digest.update(f"{name}\0{len(data)}\0".encode())
        digest.update(data)
    return AdapterFiles(str(directory), digest.hexdigest(), rank, alpha, rslora, targets, tensors, weights)


def adapter_rank(path: str) -> int:
    """The rank of the adapter at `path`, a trusted path given at start (`--lora-modules`): its directory
    and config checked as `read_adapter` checks them, its weights only found (the engine reads and checks
    them when it loads the adapter). The launcher sizes `--max-lora-rank` from it before anything starts."""
    directory = _adapter_directory(path, path)
    if not (directory / WEIGHTS_FILE).is_file():
        raise AdapterError(WEIGHTS_FILE, "is missing")
    rank, _, _, _ = _check_config(_read(directory, CONFIG_FILE, MAX_CONFIG_BYTES), None)
    return rank


def _check_config(data: bytes, max_rank: int | None) -> tuple[int, float, bool, tuple[str, ...]]:
    try:
        cfg = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(CONFIG_FILE, f"is not JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise AdapterError(CONFIG_FILE, "must be a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError("peft_type", f"{cfg.get('peft_type')!r} is not supported (only LORA)")
    r = cfg.get("r")
    if type(r) is not int or r < 1:
        raise AdapterError("r", f"must be a positive integer, got {r!r}")
    if max_rank is not None and r > max_rank:
        raise AdapterError("r", f"rank {r} exceeds --max-lora-rank {max_rank}")
    alpha = cfg.get("lora_alpha", 8)
    if type(alpha) not in (int, float) or not 0 < alpha < 1e6:
        raise AdapterError("lora_alpha", f"must be a positive number, got {alpha!r}")
    rslora = cfg.get("use_rslora", False)
    if type(rslora) is not bool:
        raise AdapterError("use_rslora", "must be true or false")
    for key, bad in (("use_dora", lambda v: bool(v)), ("fan_in_fan_out", lambda v: bool(v)),
                     ("rank_pattern", lambda v: bool(v)), ("alpha_pattern", lambda v: bool(v)),
                     ("modules_to_save", lambda v: bool(v)), ("bias", lambda v: v not in (None, "none"))):
        if bad(cfg.get(key)):
            raise AdapterError(key, f"{cfg.get(key)!r} is not supported")
    targets = cfg.get("target_modules")
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise AdapterError("target_modules", "must be a non-empty list of module names")
    unknown = sorted(set(targets) - set(TARGET_MODULES))
    if unknown:
        raise AdapterError("target_modules", f"{unknown} are not supported (only {', '.join(TARGET_MODULES)})")
    return r, float(alpha), rslora, tuple(t for t in TARGET_MODULES if t in targets)


def tensor_key(layer: int, module: str, kind: str) -> str:
    """PEFT's safetensors key of one LoRA matrix ("A" or "B") of a Llama projection."""
    block = "mlp" if module in TARGET_MODULES[4:] else "self_attn"
    return f"base_model.model.model.layers.{layer}.{block}.{module}.lora_{kind}.weight"


def _check_weights(data: bytes, rank: int, targets: tuple[str, ...]) -> dict[str, TensorInfo]:
    """The safetensors header (8-byte length, then JSON), read without torch: names, dtypes and shapes."""
    if len(data) < 8:
        raise AdapterError(WEIGHTS_FILE, "is too short to be safetensors")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise AdapterError(WEIGHTS_FILE, "header length runs past the end of the file")
    try:
        header = json.loads(data[8:8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(WEIGHTS_FILE, f"header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise AdapterError(WEIGHTS_FILE, "header must be a JSON object")
    header.pop("__metadata__", None)
    if not header:
        raise AdapterError(WEIGHTS_FILE, "holds no tensors")
    tensors: dict[str, TensorInfo] = {}
    for key, meta in header.items():
        m = _KEY.match(key)
        if m is None:
            raise AdapterError(key, "is not a LoRA A/B weight of a Llama projection")
        if not isinstance(meta, dict) or meta.get("dtype") not in _DTYPES:
            raise AdapterError(key, f"dtype must be one of {sorted(_DTYPES)}")
        shape = meta.get("shape")
        if not isinstance(shape, list) or len(shape) != 2 or not all(type(d) is int and d > 0 for d in shape):
            raise AdapterError(key, f"must be a 2-D tensor, got shape {shape!r}")
        layer, module, kind = int(m.group(1)), m.group(2) or m.group(3), m.group(4)
        if module not in targets:
            raise AdapterError(key, f"{module} is not in target_modules")
        if (shape[0] if kind == "A" else shape[1]) != rank:
            raise AdapterError(key, f"shape {shape} does not have rank r={rank}")
        tensors[key] = TensorInfo(layer, module, kind, meta["dtype"], tuple(shape))
    pairs = {(t.layer, t.module) for t in tensors.values()}
    for layer, module in sorted(pairs):
        for kind in "AB":
            key = tensor_key(layer, module, kind)
            if key not in tensors:
                raise AdapterError(key, "is missing (every LoRA A needs its B)")
    return tensors
