"""The layout of one engine step's host buffer: where each index field lives, and typed views of it.

Every field a kernel reads (token ids, positions, KV slots, rows to sample, copy-on-write pairs, block
tables, query starts, context lengths) sits in one flat byte buffer: int64 fields first, then int32, each
on a FIELD_ALIGN boundary. services/engine/step_inputs.py fills it; the model runner, the CUDA-graph
runner and the tensor-parallel broadcast read it through these views.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

_INT64_FIELDS = ("input_ids", "positions", "slot_mapping", "sample_idx", "copy_src", "copy_dst")
_INT32_FIELDS = ("decode_context_lens", "decode_block_tables", "prefill_query_start_loc",
                 "prefill_context_lens", "prefill_block_tables")
_NP = {torch.int64: np.int64, torch.int32: np.int32}
# Every field starts on a 16-byte boundary of the buffer (whose allocation is aligned wider): Triton
# specializes a kernel on whether each pointer is 16-byte aligned, so fields packed back to back would
# compile new kernel variants while serving, depending on the batch's shape.
FIELD_ALIGN = 16


@dataclass(frozen=True)
class StepLayout:
    """Where each field lives in the step buffer: int64 fields first, then int32, each starting on a
    FIELD_ALIGN boundary."""

    shapes: dict[str, tuple[int, ...]]
    spans: dict[str, tuple[int, int, torch.dtype]]  # name -> (start byte, end byte, dtype)
    nbytes: int

    @classmethod
    def of(cls, *, num_tokens: int, num_samples: int, num_decode: int, decode_width: int, num_prefill: int,
           prefill_width: int, num_copies: int = 0, num_groups: int = 1) -> StepLayout:
        """`num_groups`: KV groups (services/engine/kv_groups.py); each has its own slots and block tables."""
        shapes = {
            "input_ids": (num_tokens,), "positions": (num_tokens,), "slot_mapping": (num_groups, num_tokens),
            "sample_idx": (num_samples,), "copy_src": (num_copies,), "copy_dst": (num_copies,),
            "decode_context_lens": (num_decode,), "decode_block_tables": (num_groups, num_decode, decode_width),
            "prefill_query_start_loc": (num_prefill + 1 if num_prefill else 0,),
            "prefill_context_lens": (num_prefill,), "prefill_block_tables": (num_groups, num_prefill, prefill_width),
        }
        spans, at = {}, 0
        for name in _INT64_FIELDS + _INT32_FIELDS:
            dtype = torch.int64 if name in _INT64_FIELDS else torch.int32
            end = at + math.prod(shapes[name]) * dtype.itemsize
            spans[name] = (at, end, dtype)
            at = -(-end // FIELD_ALIGN) * FIELD_ALIGN
        return cls(shapes, spans, at)

    def host_views(self, buf: np.ndarray) -> dict[str, np.ndarray]:
        return {name: buf[start:end].view(_NP[dtype]).reshape(self.shapes[name])
                for name, (start, end, dtype) in self.spans.items()}

    def tensors(self, buf: torch.Tensor) -> StepTensors:
        """Typed views of a (device or host) copy of the buffer."""
        return StepTensors(**{name: buf[start:end].view(dtype).view(self.shapes[name])
                              for name, (start, end, dtype) in self.spans.items()})


@dataclass
class StepTensors:
    """The step's index tensors on the device, views of one buffer (empty where a field is). Slots and block
    tables have a leading KV-group dimension."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    sample_idx: torch.Tensor
    copy_src: torch.Tensor
    copy_dst: torch.Tensor
    decode_context_lens: torch.Tensor
    decode_block_tables: torch.Tensor
    prefill_query_start_loc: torch.Tensor
    prefill_context_lens: torch.Tensor
    prefill_block_tables: torch.Tensor


def decode_graph_layout(size: int, width: int, num_groups: int = 1) -> StepLayout:
    """The buffer of a captured decode graph: `size` single-token rows, tables `width` blocks wide."""
    return StepLayout.of(num_tokens=size, num_samples=size, num_decode=size, decode_width=width, num_prefill=0,
                         prefill_width=0, num_groups=num_groups)
