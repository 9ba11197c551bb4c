"""CUDA graphs for decode steps: one graph per batch size, captured once at start-up, replayed per step.

A decode step launches a few hundred small kernels (eight or so per layer); at small batches their
launch cost exceeds the work. Decode-only steps are padded up to the next captured batch size (1, 2,
4, 8, ... up to max_num_seqs) and replayed from that graph: the step's host buffer is copied into the
graph's static input buffer (one copy), the graph replays, and its static outputs hold the logits.
Padding rows write no KV slot (slot -1), attend to one position of block 0 and are never sampled.

Speculative decoding's verify steps replay the same graphs: a sequence verifying k drafts is k + 1 decode
rows, row j attending over the context up to its own position (the step writes every row's keys before
any row attends), so a step of decodes and verify rows is a decode step of that many rows. With a
speculative config the sizes go up to max_num_seqs * (1 + k) rows (at most GRAPH_MAX_VERIFY_ROWS).

A graph fixes every launch's grid and scalar arguments at capture, so the forward must take all it
needs from device buffers (services/engine/step_inputs.py) and host numbers fixed per batch size: the
block-table width and longest context (`GRAPH_MAX_CONTEXT`, like vLLM's max_seq_len_to_capture) and
the decode kernel's split count. Longer contexts, steps with prefill chunks, copy-on-write or several
samples per sequence run eagerly.

With LoRA slots (`--max-loras`), every graph is captured with the adapters' shrink and expand: each
bucket holds a static int32 tensor of per-row slots (-1: the base model, and every padding row) that a
step's slots are copied into before the replay, and the scale mask is computed from it inside the graph
(services/engine/lora/batch.py `LoraBatch.on_device`). The slot buffers never change shape, so a graph
stays valid whichever adapters are resident; a base-only step replays the same graph with every slot -1.

`CudaGraphCapture` captures real graphs; `FakeGraphCapture` runs the same code path on the CPU (replay
re-runs the captured function on the same static buffers and refills the same output tensors), so
tests cover bucket choice, padding and equality with eager execution without a GPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.engine.attention import AttentionMetadata, PagedAttention
from services.engine.lora.batch import LoraBatch, slots_per_token
from services.engine.lora.slots import LoraSlots
from services.engine.step_inputs import StepInputs, padding_step

log = logging.getLogger(__name__)

GRAPH_MAX_CONTEXT = 8192  # decodes with a longer context run eagerly
# Verify steps past this many rows run eagerly: each captured size keeps its own logits ([rows, vocab]).
GRAPH_MAX_VERIFY_ROWS = 512
WARMUP_RUNS = 2  # before capture: Triton compiles its kernels, cuBLAS picks its algorithms


def graph_rows(max_num_seqs: int, speculative=None) -> int:
    """The largest step a graph is captured for, in rows: max_num_seqs decodes, or with speculative decoding
    each sequence's verify rows (its token and k drafts), up to GRAPH_MAX_VERIFY_ROWS."""
    if speculative is None:
        return max_num_seqs
    return max(max_num_seqs, min(max_num_seqs * (1 + speculative.num_speculative_tokens), GRAPH_MAX_VERIFY_ROWS))


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, ... below max_num_seqs, then max_num_seqs itself."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    return [*sizes, max_num_seqs]


@dataclass
class CapturedGraph:
    replay: Callable[[], None]
    outputs: tuple[torch.Tensor, ...]  # refilled by every replay


class CudaGraphCapture:
    """Real CUDA graphs, sharing one memory pool (captured largest first, as vLLM does)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], tuple[torch.Tensor, ...]]) -> CapturedGraph:
        for _ in range(WARMUP_RUNS):
            fn()
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = fn()
        torch.cuda.synchronize(self.device)
        return CapturedGraph(graph.replay, tuple(outputs))


class FakeGraphCapture:
    """The CPU stand-in: capture runs the function (warm-up included, as on CUDA) and keeps its outputs;
    replay runs it again on the same static buffers and copies the results into those same outputs."""

    def __init__(self):
        self.captured = 0
        self.replays = 0

    def capture(self, fn: Callable[[], tuple[torch.Tensor, ...]]) -> CapturedGraph:
        for _ in range(WARMUP_RUNS):
            fn()
        outputs = tuple(fn())
        self.captured += 1

        def replay() -> None:
            self.replays += 1
            for out, new in zip(outputs, fn(), strict=True):
                out.copy_(new)

        return CapturedGraph(replay, outputs)


@dataclass
class _Bucket:
    size: int
    buffer: torch.Tensor  # static device copy of the step buffer
    graph: CapturedGraph
    lora_slots: torch.Tensor | None = None  # static int32 [size]: each row's LoRA slot (-1: none)


class DecodeGraphs:
    """Captured decode graphs by batch size, and the replay of a padded decode step."""

    def __init__(self, model, kv_caches, attention: PagedAttention, device: torch.device, block_size: int,
                 max_rows: int, max_model_len: int, capture, lora: LoraSlots | None = None,
                 num_groups: int = 1):
        self.block_size = block_size
        self.max_context = min(GRAPH_MAX_CONTEXT, max_model_len)
        self.width = -(-self.max_context // block_size)
        self.sizes = capture_sizes(max_rows)
        self.lora = lora
        self.buckets: dict[int, _Bucket] = {}
        started = time.monotonic()
        for size in reversed(self.sizes):
            pad = padding_step(size, self.width, block_size, num_groups)
            buffer = pad.host.to(device)
            t = pad.layout.tensors(buffer)
            splits = attention.backend.num_splits(size, model.num_kv_heads, self.max_context)
            meta = [AttentionMetadata(
                slot_mapping=t.slot_mapping[g], num_decode=size, decode_block_tables=t.decode_block_tables[g],
                decode_context_lens=t.decode_context_lens, decode_max_context_len=self.max_context,
                decode_num_splits=splits, prefill_block_tables=None, prefill_query_start_loc=None,
                prefill_context_lens=None) for g in range(num_groups)]

            lora_slots = torch.full((size,), -1, dtype=torch.int32, device=device) if lora is not None else None

            def forward(t=t, meta=meta, lora_slots=lora_slots):
                batch = LoraBatch.on_device(lora, lora_slots) if lora_slots is not None else None
                return model.forward(t.input_ids, t.positions, meta, kv_caches, t.sample_idx, batch)

            self.buckets[size] = _Bucket(size, buffer, capture.capture(forward), lora_slots)
        log.info("captured decode graphs for batch sizes %s (contexts up to %d) in %.1f s", self.sizes,
                 self.max_context, time.monotonic() - started)

    def batch_for(self, num_decodes: int, max_context_len: int, uses_lora: bool = False) -> tuple[int, int] | None:
        """(captured batch size, table width) a decode step pads to, or None to run it eagerly."""
        if max_context_len > self.max_context or num_decodes > self.sizes[-1] or (uses_lora and self.lora is None):
            return None
        size = next(b for b in self.sizes if b >= num_decodes)
        return size, self.width

    def run(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        bucket = self.buckets[step.graph_batch]
        assert step.host.numel() == bucket.buffer.numel(), "step not built for this graph"
        bucket.buffer.copy_(step.host, non_blocking=True)
        if bucket.lora_slots is not None:
            bucket.lora_slots.copy_(slots_per_token(step.lora_segments, 0, bucket.size), non_blocking=True)
        bucket.graph.replay()
        logits, hidden = bucket.graph.outputs
        return logits, hidden
