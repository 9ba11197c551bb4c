"""Paged-attention kernels: Triton versions for CUDA and PyTorch references (the CPU backend).

Public API: write_kv, decode_attention, prefill_attention and their *_ref twins, same signatures.
"""

from kernels.reference import decode_attention_ref, prefill_attention_ref, write_kv_ref

__all__ = ["decode_attention_ref", "prefill_attention_ref", "write_kv_ref"]
