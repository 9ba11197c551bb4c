"""Executes one SchedulerOutput: builds the flattened batch, runs the model, samples.

Owns the weights and the KV cache tensors (one key and one value tensor per layer shaped
`[num_blocks, block_size, num_kv_heads, head_dim]`). Makes no scheduling decision.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

import kernels.cpu as cpu_kernels
from services.engine.attention import AttentionMetadata
from services.engine.config import EngineConfig
from services.engine.model_loader import load_llama
from services.engine.sampler import Sampler, SampleRow
from services.model_source import model_id_of, resolve_model
from services.step_protocol import EngineInfo, ModelRunnerOutput, SchedulerOutput

log = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def advise_huge_pages(t: torch.Tensor) -> None:
    """Ask Linux for transparent huge pages under a large CPU tensor (needed when THP is 'madvise')."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    huge = 2 << 20
    start = (t.data_ptr() + huge - 1) & ~(huge - 1)
    end = (t.data_ptr() + t.numel() * t.element_size()) & ~(huge - 1)
    if end > start:
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 14)  # MADV_HUGEPAGE


def _eos_ids(model_dir: Path, hf_cfg: dict) -> list[int]:
    ids: set[int] = set()
    sources = [hf_cfg.get("eos_token_id")]
    gen = model_dir / "generation_config.json"
    if gen.exists():
        sources.append(json.loads(gen.read_text()).get("eos_token_id"))
    for src in sources:
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, list):
            ids.update(int(x) for x in src)
    return sorted(ids)


class ModelRunner:
    def __init__(self, config: EngineConfig):
        dtype, block_size = config.dtype, config.block_size
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        self.config = config
        self.model_dir = resolve_model(config.model)
        self.device = pick_device(config.device)
        self.dtype = _DTYPES[dtype]
        if self.device.type == "cpu" and self.dtype == torch.float16:
            log.warning("float16 on the CPU is slow; bfloat16 is the fast half-precision type there")
        self.model, hf_cfg = load_llama(self.model_dir, self.dtype, self.device)
        cfg = self.model.config
        self.block_size = block_size
        per_block = 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * self.dtype.itemsize
        self.num_kv_blocks = config.num_kv_blocks or max(2, config.kv_cache_memory // per_block)
        shape = (self.num_kv_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        # One allocation for every layer's keys and values, so that on the CPU it can be backed by huge
        # pages (random block reads thrash the TLB with 4 KiB pages). Zero-filled, not empty: padding
        # slots are read (and masked) by batched attention, and uninitialised memory may hold NaNs.
        arena = torch.empty((cfg.num_layers, 2, *shape), dtype=self.dtype, device=self.device)
        if self.device.type == "cpu":
            advise_huge_pages(arena)
        arena.zero_()
        self.kv_caches = [(arena[i, 0], arena[i, 1]) for i in range(cfg.num_layers)]
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        # Build (or load) the C++ kernels now, whatever the dtype: attention uses them in float32 too, and
        # a first build takes about a minute that must not land on the first request after "ready".
        built = cpu_kernels.load() if self.device.type == "cpu" else None
        fast = built if self.dtype != torch.float32 else None
        self.sampler = Sampler(self.device, fast.argmax_rows if fast is not None else None,
                               fast.argmax_rows_exact if fast is not None else None)
        self.info = EngineInfo(
            model_id=model_id_of(config.model, self.model_dir),
            block_size=block_size, num_kv_blocks=self.num_kv_blocks, max_model_len=self.max_model_len,
            vocab_size=cfg.vocab_size, dtype=dtype, device=str(self.device),
            eos_token_ids=_eos_ids(self.model_dir, hf_cfg))
        log.info("engine ready: %s on %s, %d KV blocks of %d tokens (%.2f GiB)", self.info.model_id,
                 self.device, self.num_kv_blocks, block_size, self.num_kv_blocks * per_block / 2**30)

    def reset(self) -> None:
        for k, v in self.kv_caches:
            k.zero_()
            v.zero_()

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        src = torch.tensor([p[0] for p in pairs], device=self.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.device)
        for k, v in self.kv_caches:
            k.index_copy_(0, dst, k.index_select(0, src))
            v.index_copy_(0, dst, v.index_select(0, src))

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        if out.blocks_to_copy:
            self._copy_blocks(out.blocks_to_copy)
        bs = self.block_size
        # Decodes that share prefix blocks sit next to each other, so the attention kernel finds the
        # shared blocks still in cache when it reaches the next sequence of the group.
        decodes = sorted((s for s in out.sequences if len(s.token_ids) == 1), key=lambda s: s.block_table[0])
        prefills = [s for s in out.sequences if len(s.token_ids) > 1]
        ordered = decodes + prefills
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for s in decodes:
            p = s.start_pos
            input_ids.append(s.token_ids[0])
            positions.append(p)
            slots.append(s.block_table[p // bs] * bs + p % bs)
        q_starts = [0]
        for s in prefills:
            n = len(s.token_ids)
            input_ids.extend(s.token_ids)
            pos = range(s.start_pos, s.start_pos + n)
            positions.extend(pos)
            table = s.block_table
            slots.extend([table[p // bs] * bs + p % bs for p in pos])
            q_starts.append(q_starts[-1] + n)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            num_decode=len(decodes),
            decode_block_tables=self._block_tables(decodes),
            decode_context_lens=self._int_tensor([s.start_pos + 1 for s in decodes]) if decodes else None,
            prefill_block_tables=self._block_tables(prefills),
            prefill_query_start_loc=self._int_tensor(q_starts) if prefills else None,
            prefill_context_lens=(self._int_tensor([s.start_pos + len(s.token_ids) for s in prefills])
                                  if prefills else None),
            prefill_spans=[(q_starts[i], q_starts[i + 1], s.start_pos + len(s.token_ids))
                           for i, s in enumerate(prefills)],
            step_cache={},
        )
        # Rows to sample: the last token of each sequence that samples, once per requested sample.
        sample_idx: list[int] = []
        rows: list[SampleRow] = []
        owners: list[str] = []
        end = 0
        for s in ordered:
            end += len(s.token_ids)
            if s.sample:
                for j in range(s.num_samples):
                    sample_idx.append(end - 1)
                    rows.append(SampleRow(s.sampling, s.sample_index + j, s.output_index, s.banned_token_ids))
                    owners.append(s.seq_id)
        result = ModelRunnerOutput(step_id=out.step_id)
        logits, hidden = self.model.forward(
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev), meta, self.kv_caches,
            torch.tensor(sample_idx, dtype=torch.long, device=dev))
        if not rows:
            return result
        tokens, logprobs = self.sampler(logits, rows, hidden, self.model.head_weight)
        for seq_id, tok, lp in zip(owners, tokens, logprobs, strict=True):
            result.sampled.setdefault(seq_id, []).append(tok)
            if lp is not None:
                result.logprobs.setdefault(seq_id, []).append(lp)
        return result

    def _int_tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=self.device)

    def _block_tables(self, seqs) -> torch.Tensor | None:
        if not seqs:
            return None
        width = max(len(s.block_table) for s in seqs)
        rows = [s.block_table + [0] * (width - len(s.block_table)) for s in seqs]
        return torch.tensor(rows, dtype=torch.int32, device=self.device)
