"""What changes an engine's adapters, as one list every tensor-parallel rank applies in the same order:
add an adapter to host memory, forget one, put one in a slot.

Rank 0 alone reads and checks adapter files; it sends the other ranks the checked files themselves
(the safetensors bytes and what `read_adapter` found in them), so every rank slices its own shard from
exactly the bytes whose digest names the adapter, with no shared filesystem and no second read that
could see other bytes. The encoding is a JSON header then the raw weight bytes: nothing is unpickled."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

from services.model_files.lora_files import AdapterFiles, TensorInfo

_LEN = struct.Struct("<Q")


@dataclass(frozen=True)
class LoraCommand:
    op: str  # "add" (files, path), "forget", "activate" (slot)
    digest: str
    path: str = ""
    slot: int = -1
    files: AdapterFiles | None = None


def _files_header(f: AdapterFiles) -> dict:
    return {"path": f.path, "digest": f.digest, "rank": f.rank, "alpha": f.alpha, "use_rslora": f.use_rslora,
            "target_modules": list(f.target_modules),
            "tensors": {k: [t.layer, t.module, t.kind, t.dtype, list(t.shape)] for k, t in f.tensors.items()},
            "nbytes": len(f.weights)}


def encode(commands: list[LoraCommand]) -> bytes:
    heads, blobs = [], []
    for c in commands:
        head = {"op": c.op, "digest": c.digest, "path": c.path, "slot": c.slot}
        if c.files is not None:
            head["files"] = _files_header(c.files)
            blobs.append(c.files.weights)
        heads.append(head)
    header = json.dumps(heads).encode()
    return b"".join([_LEN.pack(len(header)), header, *blobs])


def decode(data: bytes | memoryview) -> list[LoraCommand]:
    data = memoryview(data)
    (n,) = _LEN.unpack(data[:_LEN.size])
    at = _LEN.size + n
    out = []
    for head in json.loads(bytes(data[_LEN.size:at])):
        files = None
        if "files" in head:
            f = head["files"]
            weights = bytes(data[at:at + f["nbytes"]])
            at += f["nbytes"]
            tensors = {k: TensorInfo(layer, module, kind, dtype, tuple(shape))
                       for k, (layer, module, kind, dtype, shape) in f["tensors"].items()}
            files = AdapterFiles(f["path"], f["digest"], f["rank"], f["alpha"], f["use_rslora"],
                                 tuple(f["target_modules"]), tensors, weights)
        out.append(LoraCommand(head["op"], head["digest"], head["path"], head["slot"], files))
    if at != len(data):
        raise ValueError(f"LoRA command message of {len(data)} bytes, {at} expected")
    return out
