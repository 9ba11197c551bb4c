"""What an engine is built from: model, dtype, device, KV cache geometry, attention backend, CUDA graphs,
tensor parallelism. One dataclass, filled from the CLI flags (`pagedserve engine`, `engine-worker`,
`serve`, `up`) or from the offline `LLM(...)` arguments, so every way of starting an engine builds it
the same way; `as_flags()` turns it back into flags for the ranks an engine starts. Imports no torch."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from services.contracts.byte_size import parse_bytes
from services.contracts.speculative_config import SpeculativeConfig

LOAD_FORMATS = ("safetensors", "random")
QUANTIZATIONS = (None, "gguf", "fp8", "gptq", "awq", "compressed-tensors")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


MAX_LORA_RANK = 512  # vLLM's largest --max-lora-rank too


class EngineConfigError(ValueError):
    """A setting no engine can be built with; `field` names it (the flag is `--` + field with dashes)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field} {message}")
        self.field = field
        self.message = message


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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
    # Speculative decoding (a JSON object, services.contracts.speculative_config): the engine loads a draft
    # model or EAGLE-3 head for the methods that need one; n-gram needs nothing here.
    speculative_config: str | None = None
    # What the checkpoint's weights must be (vLLM's --quantization); "gguf": a GGUF file's weights are read
    # as they are instead of being converted to a float checkpoint. None: whatever the checkpoint says.
    quantization: str | None = None
    kv_cache_dtype: str = "auto"  # "auto": the model's dtype; "fp8" / "fp8_e4m3": e4m3 with per-tensor scales

    def __post_init__(self):
        def refuse(name: str, message: str):
            raise EngineConfigError(name, message)

        if self.load_format not in LOAD_FORMATS:
            refuse("load_format", f"must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        if not _is_int(self.block_size) or self.block_size < 1 or self.block_size & (self.block_size - 1):
            refuse("block_size", f"must be a power of two, got {self.block_size!r}")
        if self.num_kv_blocks is not None and (not _is_int(self.num_kv_blocks) or self.num_kv_blocks < 1):
            refuse("num_kv_blocks", f"must be an integer >= 1, got {self.num_kv_blocks!r}")
        if not _is_int(self.kv_cache_memory) or self.kv_cache_memory < 1:
            refuse("kv_cache_memory", f"must be a positive number of bytes, got {self.kv_cache_memory!r}")
        if self.max_model_len is not None and (not _is_int(self.max_model_len) or self.max_model_len < 1):
            refuse("max_model_len", f"must be an integer >= 1, got {self.max_model_len!r}")
        if not _is_int(self.max_num_seqs) or self.max_num_seqs < 1:
            refuse("max_num_seqs", f"must be an integer >= 1, got {self.max_num_seqs!r}")
        if not _is_int(self.tensor_parallel_size) or self.tensor_parallel_size < 1:
            refuse("tensor_parallel_size", f"must be an integer >= 1, got {self.tensor_parallel_size!r}")
        local = self.tp_local_ranks
        if local is not None and not (_is_int(local) and 1 <= local <= self.tensor_parallel_size
                                      and self.tensor_parallel_size % local == 0):
            refuse("tp_local_ranks", f"must divide tensor_parallel_size {self.tensor_parallel_size} "
                   f"(ranks per machine), got {local}")
        if not _is_int(self.max_loras) or self.max_loras < 0:
            refuse("max_loras", f"must be an integer >= 0, got {self.max_loras!r}")
        if not _is_int(self.max_lora_rank) or not 1 <= self.max_lora_rank <= MAX_LORA_RANK:
            refuse("max_lora_rank", f"must be an integer in [1, {MAX_LORA_RANK}], got {self.max_lora_rank!r}")
        if self.max_cpu_loras is not None and (not _is_int(self.max_cpu_loras) or self.max_cpu_loras < 1):
            refuse("max_cpu_loras", f"must be an integer >= 1, got {self.max_cpu_loras!r}")
        if not isinstance(self.tp_timeout, (int, float)) or not 0 < self.tp_timeout < float("inf"):
            refuse("tp_timeout", f"must be > 0 seconds, got {self.tp_timeout!r}")
        if self.quantization not in QUANTIZATIONS:
            refuse("quantization", f"must be one of {', '.join(q for q in QUANTIZATIONS if q)}, got "
                   f"{self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            refuse("kv_cache_dtype", f"must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        spec = self.speculative
        if spec is not None and spec.proposer_in_engine and self.tensor_parallel_size > 1:
            refuse("speculative_config", f"method {spec.method!r} is not implemented with tensor parallelism "
                   f"(ngram is)")

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.parse(self.speculative_config)

    @property
    def ranks_per_machine(self) -> int:
        return self.tp_local_ranks or self.tensor_parallel_size

    def worker_rank(self, node_rank: int, local_rank: int) -> int:
        """The group rank of the worker at (`node_rank`, `local_rank`): one of 1..N-1, else EngineConfigError."""
        size, local = self.tensor_parallel_size, self.ranks_per_machine
        if self.tp_rendezvous is None:
            raise EngineConfigError("tp_rendezvous", "is required by a rank other than 0 (rank 0's engine passes it to "
                                    "the ranks it starts; on another machine: tcp://<rank 0's host>:<port>)")
        rank = node_rank * local + local_rank
        if size < 2 or not 0 < rank < size or not 0 <= local_rank < local:
            raise EngineConfigError("tp_node_rank", f"{node_rank} with tp_local_rank {local_rank} is no rank "
                                    f"1..{size - 1} of a group of {size} with {local} ranks per machine")
        return rank

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
                   max_cpu_loras=opt("max_cpu_loras", None),
                   speculative_config=opt("speculative_config", None) or None,
                   quantization=opt("quantization", None), kv_cache_dtype=opt("kv_cache_dtype", "auto"))

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
