"""What an engine is built from: model, dtype, device, KV cache geometry, attention backend, CUDA graphs,
tensor parallelism. One dataclass, filled from the CLI flags (`pagedserve engine`, `engine-worker`,
`serve`, `up`) or from the offline `LLM(...)` arguments, so every way of starting an engine builds it
the same way; `as_flags()` turns it back into flags for the ranks an engine starts. Imports no torch."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from services.contracts.byte_size import parse_bytes

LOAD_FORMATS = ("safetensors", "random")
QUANTIZATIONS = (None, "gguf", "fp8", "gptq", "awq", "compressed-tensors")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


@dataclass
class EngineConfig:
    model: str | None = None  # Hugging Face directory, .gguf file, or None for the bundled model
    dtype: str = "bfloat16"
    device: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None  # overrides kv_cache_memory
    kv_cache_memory: int = 4 << 30  # bytes (per rank with tensor parallelism)
    max_model_len: int | None = None
    attention_backend: str = "auto"  # triton | cpu | reference; auto: triton on CUDA, cpu on the CPU
    enforce_eager: bool = False  # no CUDA graphs for decode steps
    max_num_seqs: int = 256  # the largest decode batch captured in a CUDA graph
    # random: weights drawn in the shapes of the model directory's config.json (benchmarks, no download)
    load_format: str = "safetensors"
    tensor_parallel_size: int = 1  # ranks one model replica is split across
    tp_local_ranks: int | None = None  # ranks on each machine; None: all of them on this one
    tp_rendezvous: str | None = None  # tcp://host:port when the group spans machines; None: a private file
    tp_timeout: float = 60.0  # seconds a rank waits in a collective before the group counts as broken
    max_loras: int = 0  # LoRA adapter slots resident at once (0: no adapters)
    max_lora_rank: int = 16  # the rank every slot is padded to; an adapter of higher rank is refused
    max_cpu_loras: int | None = None  # loaded adapters kept in host memory (default: max(max_loras, 8))
    # What the checkpoint's weights must be (vLLM's --quantization); "gguf": a GGUF file's weights are read
    # as they are instead of being converted to a float checkpoint. None: whatever the checkpoint says.
    quantization: str | None = None
    kv_cache_dtype: str = "auto"  # "auto": the model's dtype; "fp8" / "fp8_e4m3": e4m3 with per-tensor scales

    def __post_init__(self):
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        local = self.tp_local_ranks
        if local is not None and not (1 <= local <= self.tensor_parallel_size
                                      and self.tensor_parallel_size % local == 0):
            raise ValueError(f"tp_local_ranks must divide tensor_parallel_size {self.tensor_parallel_size} "
                             f"(ranks per machine), got {local}")
        if not isinstance(self.max_loras, int) or self.max_loras < 0:
            raise ValueError(f"max_loras must be an integer >= 0, got {self.max_loras!r}")
        if not isinstance(self.max_lora_rank, int) or not 1 <= self.max_lora_rank <= 512:
            raise ValueError(f"max_lora_rank must be an integer in [1, 512], got {self.max_lora_rank!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(q for q in QUANTIZATIONS if q)}, got "
                             f"{self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if not self.tp_timeout > 0:
            raise ValueError(f"tp_timeout must be > 0 seconds, got {self.tp_timeout!r}")

    @property
    def ranks_per_machine(self) -> int:
        return self.tp_local_ranks or self.tensor_parallel_size

    @classmethod
    def from_args(cls, args) -> EngineConfig:
        """From the parsed flags of any command that starts an engine (services.commands.settings)."""
        def opt(name: str, default):
            value = getattr(args, name, None)
            return default if value is None else value

        return cls(model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
                   num_kv_blocks=args.num_kv_blocks, kv_cache_memory=parse_bytes(args.kv_cache_memory),
                   max_model_len=args.max_model_len, attention_backend=args.attention_backend,
                   enforce_eager=bool(args.enforce_eager), max_num_seqs=args.max_num_seqs,
                   load_format=opt("load_format", "safetensors"),
                   tensor_parallel_size=opt("tensor_parallel_size", 1), tp_local_ranks=opt("tp_local_ranks", None),
                   tp_rendezvous=opt("tp_rendezvous", None), tp_timeout=opt("tp_timeout", 60.0),
                   max_loras=opt("max_loras", 0), max_lora_rank=opt("max_lora_rank", 16),
                   max_cpu_loras=opt("max_cpu_loras", None), quantization=opt("quantization", None),
                   kv_cache_dtype=opt("kv_cache_dtype", "auto"))

    def as_flags(self) -> list[str]:
        """The flags that rebuild this config (`from_args(parse(as_flags()))` equals it)."""
        out = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            flag = "--" + f.name.replace("_", "-")
            if value is None:
                continue
            if isinstance(value, bool):
                out.append(flag if value else "--no-" + flag[2:])
            else:
                out += [flag, str(value)]
        return out
