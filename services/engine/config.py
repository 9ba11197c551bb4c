"""What an engine is built from: model, dtype, device, KV cache geometry, attention backend, CUDA graphs.
One dataclass, filled from the CLI flags (`pagedserve engine`, `serve`, `up`) or from the offline
`LLM(...)` arguments, so every way of starting an engine builds it the same way. Imports no torch."""

from __future__ import annotations

from dataclasses import dataclass

from services.settings import parse_bytes


@dataclass
class EngineConfig:
    model: str | None = None  # Hugging Face directory, .gguf file, or None for the bundled model
    dtype: str = "bfloat16"
    device: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None  # overrides kv_cache_memory
    kv_cache_memory: int = 4 << 30  # bytes
    max_model_len: int | None = None
    attention_backend: str = "auto"  # triton | cpu | reference; auto: triton on CUDA, cpu on the CPU
    enforce_eager: bool = False  # no CUDA graphs for decode steps
    max_num_seqs: int = 256  # the largest decode batch captured in a CUDA graph

    @classmethod
    def from_args(cls, args) -> EngineConfig:
        """From the parsed flags of any command that starts an engine (services.settings)."""
        return cls(model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
                   num_kv_blocks=args.num_kv_blocks, kv_cache_memory=parse_bytes(args.kv_cache_memory),
                   max_model_len=args.max_model_len, attention_backend=args.attention_backend,
                   enforce_eager=bool(args.enforce_eager), max_num_seqs=args.max_num_seqs)
