"""Executes one SchedulerOutput: builds the step's inputs on the host, runs the model, samples.

Owns the weights, the KV cache tensors (one key and one value tensor per layer shaped
`[num_blocks, block_size, num_kv_heads, head_dim]`, slots of one arena shared by the model's KV groups:
services/engine/kv_groups.py) and the decode CUDA graphs. Per step: validate and
lay out the inputs on the host (services/engine/step_inputs.py), copy them to the device once, run the
forward (eagerly, or a decode step replayed from its graph), sample. Makes no scheduling decision.

With a `RankGroup` it is one rank of a tensor-parallel engine: it holds its shard of the weights and
of the KV cache (its KV heads, the same blocks as every rank). Rank 0 executes steps as above and
broadcasts each validated step's buffer to the other ranks before its forward
(services/engine/step_broadcast.py); they run the same forward from it (`run_step`,
services/engine/tp_worker.py); rank 0 samples from the gathered logits.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import torch
import xxhash

import kernels.cpu as cpu_kernels
from services.contracts.step_protocol import EngineInfo, ModelRunnerOutput, SchedulerOutput
from services.engine.attention import AttentionMetadata, resolve_backend
from services.engine.config import EngineConfig
from services.engine.cpu_allocator import tune_cpu_heap
from services.engine.cuda_graphs import CudaGraphCapture, DecodeGraphs, graph_rows
from services.engine.kernel_warmup import warm_up
from services.engine.kv_cache_fp8 import cache_dtype
from services.engine.load_memory import RankMemory, memory_in_use
from services.engine.lora.adapters import LoraAdapters, check_step_slots
from services.engine.lora.batch import LoraBatch
from services.engine.model_loader import load_model, random_model, read_config
from services.engine.model_options import check_lora_support, check_model_options
from services.engine.models.registry import MODULE_PATH, choose_model
from services.engine.parallel_state import RankGroup
from services.engine.sampler import Sampler
from services.engine.spec_decode.draft_model import DraftModel
from services.engine.spec_decode.eagle3 import Eagle3Drafter
from services.engine.spec_decode.verify import commit_verified
from services.engine.step_broadcast import Op, StepSender
from services.engine.step_inputs import StepInputBuilder, StepInputs
from services.engine.step_layout import StepTensors
from services.engine.step_validation import StepLimits
from services.model_files.lora_files import AdapterError
from services.model_files.model_source import model_id_of, resolve_model, resolve_weights

log = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _code(text: str) -> int:
    """A string as an int64 (ranks compare settings through an integer all-gather)."""
    return xxhash.xxh3_64_intdigest(text.encode()) & ((1 << 63) - 1)


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device cuda: no CUDA device is visible here (torch {torch.__version__}, "
                         f"{'CUDA ' + torch.version.cuda if torch.version.cuda else 'built without CUDA'}); "
                         "use --device cpu or auto")
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


def _describe_groups(plan) -> str:
    if plan.num_groups == 1 and plan.windows[0] is None:
        return ""
    kinds = ", ".join(f"{plan.windows.count(w)} x {'full' if w is None else f'window {w}'}"
                      for w in dict.fromkeys(plan.windows))
    return f"; KV groups of {plan.group_size} layers: {kinds}"


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
    """`graph_capture`: how decode graphs are captured (default: CUDA graphs on a CUDA device with the
    Triton backend, unless `config.enforce_eager`; tests pass a FakeGraphCapture on the CPU).
    `random_weights`: a Hugging Face config dict to build that model with random weights instead of
    loading `config.model` (the GPU check, on a machine with nothing to download).
    `group`: this rank's tensor-parallel group (None: the whole model in this process)."""

    def __init__(self, config: EngineConfig, *, graph_capture=None, random_weights: dict | None = None,
                 group: RankGroup | None = None):
        dtype, block_size = config.dtype, config.block_size
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        self.config = config
        self.group = group
        self.device = group.device if group is not None else pick_device(config.device)
        self.dtype = _DTYPES[dtype]
        if self.device.type == "cpu":
            tune_cpu_heap()  # before the weights load: every later step's tensors come from the heap
        backend = resolve_backend(config.attention_backend, self.device)
        if self.device.type == "cpu" and self.dtype == torch.float16:
            log.warning("float16 on the CPU is slow; bfloat16 is the fast half-precision type there")
        if random_weights is None and config.load_format == "random":
            random_weights = read_config(resolve_model(config.model))
        # The checkpoint's config checked (and transformers' config classes imported: library code, like torch)
        # before the memory baseline that the load's growth is measured from.
        self.model_dir, gguf = (resolve_weights(config.model, config.quantization) if random_weights is None
                                else (None, None))
        if random_weights is None:
            read_config(self.model_dir)
        else:
            choose_model(random_weights)
        start_bytes = memory_in_use(self.device)
        self.model_path = MODULE_PATH
        if random_weights is None:
            self.model, hf_cfg, self.model_path = load_model(self.model_dir, self.dtype, self.device, backend, group,
                                                             config.max_model_len, quantization=config.quantization,
                                                             gguf=gguf)
            model_id, eos = model_id_of(config.model, self.model_dir), _eos_ids(self.model_dir, hf_cfg)
        else:
            hf_cfg = random_weights
            self.model = random_model(hf_cfg, self.dtype, self.device, backend, group=group,
                                      max_model_len=config.max_model_len)
            model_id, eos = hf_cfg.get("_name_or_path", "random-weights"), []
        check_lora_support(self.model, self.model_path, config)
        if group is not None:
            group.connect()  # every rank has its shard by now
        cfg = self.model.config
        self.block_size = block_size
        plan = self.kv_plan = self.model.kv_plan
        # A block is one page of `group_size` layers (all of them without sliding windows). A rank's cache
        # holds its own KV heads: the same number of blocks fits on every rank. An FP8 cache's pool is sized
        # by its one-byte element: twice the blocks of a bfloat16 one.
        self.cache_dtype = cache_dtype(config.kv_cache_dtype, self.dtype)
        check_model_options(self.model, self.model_path, config, self.cache_dtype, plan)
        self.model.kv_scales = self._kv_scales(config.kv_cache_dtype)
        # A latent-attention model (MLA) caches one tensor per layer, read as keys and values alike.
        kv_tensors = 1 if getattr(self.model, "kv_latent", False) else 2
        per_block = (kv_tensors * plan.group_size * block_size * self.model.num_kv_heads * cfg.head_dim
                     * self.cache_dtype.itemsize)
        # What one token costs in every layer's cache, on this rank (the MLA tests read it).
        self.kv_bytes_per_token = kv_tensors * cfg.num_layers * self.model.num_kv_heads * cfg.head_dim * \
            self.cache_dtype.itemsize
        # Speculative decoding's draft model: its own KV cache over the same block ids (sized together).
        self.drafter = self._load_drafter(backend)
        if self.drafter is not None:
            per_block += self.drafter.bytes_per_block(block_size)
        self.num_kv_blocks = config.num_kv_blocks or max(2, config.kv_cache_memory // per_block)
        shape = (self.num_kv_blocks, block_size, self.model.num_kv_heads, cfg.head_dim)
        # One allocation for every layer's keys and values, so that on the CPU it can be backed by huge
        # pages (random block reads thrash the TLB with 4 KiB pages). Zero-filled, not empty: padding
        # slots are read (and masked) by batched attention, and uninitialised memory may hold NaNs.
        arena_shape = (plan.group_size, kv_tensors, *shape)
        try:
            self.arena = torch.empty(arena_shape, dtype=self.cache_dtype, device=self.device)
        except (RuntimeError, MemoryError) as exc:  # torch's out-of-memory, on the CPU as on CUDA
            size = math.prod(arena_shape) * self.cache_dtype.itemsize
            raise ValueError(f"kv_cache_memory: a KV cache of {self.num_kv_blocks} blocks ({size / 2**30:.1f} GiB) "
                             f"does not fit on {self.device}: give a smaller --kv-cache-memory or --num-kv-blocks "
                             f"({str(exc).splitlines()[0][:200]})") from None
        if self.device.type == "cpu":
            advise_huge_pages(self.arena)
        self.arena.zero_()
        self.kv_caches = [(self.arena[s, 0], self.arena[s, kv_tensors - 1]) for s in plan.layer_slot]
        self.max_model_len = self.model.max_model_len
        self.memory = [RankMemory(0 if group is None else group.rank, self.model.weight_bytes,
                                  self.arena.numel() * self.arena.element_size(), start_bytes)]
        if group is not None:
            self.memory = self._check_group_geometry(hf_cfg)
        # Build (or load) the C++ kernels now wherever they run (the CPU backend's attention in any dtype,
        # the half-precision sampler): a first build takes about a minute that must not land on the first
        # request after "ready". A float32 engine on another backend needs none (the GPU check's dry run
        # runs without a compiler or ninja).
        needs_cpu_kernels = self.device.type == "cpu" and (backend == "cpu" or self.dtype != torch.float32)
        built = cpu_kernels.load() if needs_cpu_kernels else None
        fast = built if self.dtype != torch.float32 else None
        self.sampler = Sampler(self.device, fast.argmax_rows if fast is not None else None,
                               fast.argmax_rows_exact if fast is not None else None)
        if self.drafter is not None:
            self.drafter.check_target(cfg.vocab_size, self.max_model_len)
            self.drafter.allocate(self.num_kv_blocks, block_size, self.max_model_len)
        num_drafts = self.drafter.num_tokens if self.drafter is not None else 0
        self.inputs = StepInputBuilder(StepLimits(block_size, self.num_kv_blocks, self.max_model_len,
                                                  cfg.vocab_size, max_propose=num_drafts,
                                                  num_kv_groups=plan.num_groups), self.device)
        if self.device.type == "cuda" and backend == "triton":
            warm_up(self)  # every kernel variant compiles now, not while serving
        self.sender = None
        # Every rank holds its slice of each adapter; rank 0 sends the others every change it makes (its
        # sender starts below; nothing is sent before the first load). The slots exist before the graphs:
        # decode graphs read them.
        self.lora = LoraAdapters(config, cfg, self.model.shard, self.dtype, self.device,
                                 self._send_lora if group is not None and group.rank == 0 else None
                                 ) if config.max_loras else None
        # Every rank captures the same graphs in the same order: their collectives pair up.
        # An EAGLE-3 head reads hidden states of every decode, which the captured graphs do not keep.
        eager = config.enforce_eager or isinstance(self.drafter, Eagle3Drafter)
        self.graphs = None if eager else self.capture_decode_graphs(graph_capture)
        if group is not None and group.rank == 0:
            self.sender = StepSender(group, heartbeat_s=min(5.0, group.timeout_s / 4))
            self.sender.start_heartbeat()
        self.info = EngineInfo(
            model_id=model_id, block_size=block_size, num_kv_blocks=self.num_kv_blocks,
            max_model_len=self.max_model_len, vocab_size=cfg.vocab_size, dtype=dtype, device=str(self.device),
            eos_token_ids=eos, max_loras=config.max_loras,
            max_lora_rank=config.max_lora_rank if config.max_loras else 0, kv_group_windows=plan.wire_windows,
            model_path=self.model_path,
            draft_method=config.speculative.method if self.drafter is not None else "", max_draft_tokens=num_drafts)
        if group is not None and group.rank != 0:
            log.info("tensor-parallel rank %d of %d ready on %s: %s", group.rank, group.size, self.device,
                     self.memory[group.rank].describe())
            return
        tp = "" if group is None else f", tensor parallel over {group.size} ranks"
        log.info("engine ready: %s on %s, %s attention%s%s, %d KV blocks of %d tokens (%.2f GiB%s)%s",
                 self.info.model_id, self.device, backend, ", CUDA graphs" if self.graphs is not None else "", tp,
                 self.num_kv_blocks, block_size, self.num_kv_blocks * per_block / 2**30,
                 "" if group is None else " per rank", _describe_groups(plan))
        for m in self.memory:
            log.info("memory: %s", m.describe())

    def _load_drafter(self, backend: str) -> DraftModel | None:
        spec = self.config.speculative
        if spec is None or not spec.proposer_in_engine:
            return None  # n-gram drafts come from the scheduler: nothing to load
        if spec.method == "eagle3":
            drafter = Eagle3Drafter(spec.model, self.dtype, self.device, backend, self.model,
                                    spec.num_speculative_tokens)
        elif spec.method == "draft_model":
            drafter = DraftModel(spec.model, self.dtype, self.device, backend, spec.num_speculative_tokens)
        else:
            raise ValueError(f"speculative_config.method {spec.method!r} is not implemented in this engine")
        log.info("%s drafter %s: %d layers, proposes up to %d tokens per step", spec.method, drafter.model_dir,
                 drafter.config.num_layers, spec.num_speculative_tokens)
        return drafter

    def _kv_scales(self, kv_cache_dtype: str) -> list[tuple[float, float]] | None:
        found = getattr(self.model, "checkpoint_kv_scales", None)
        if cache_dtype(kv_cache_dtype, self.dtype) != torch.float8_e4m3fn:
            if found is not None:
                log.info("the checkpoint has FP8 KV cache scales; --kv-cache-dtype fp8 would use them")
            return None
        if found is None:
            log.info("FP8 KV cache: the checkpoint has no k_scale/v_scale; every scale is 1.0 (as vLLM)")
            return [(1.0, 1.0)] * self.model.config.num_layers
        return found

    def _send_lora(self, commands: bytes) -> None:
        with self.group.exclusive("LoRA adapters"):
            self.sender.send_lora(commands)

    def load_lora(self, path: str) -> dict:
        """Read, check and keep the adapter in directory `path` (trusted: the scheduler checked where it is),
        on every rank; returns {"digest", "rank"}. Raises AdapterError naming what is wrong."""
        if self.lora is None:
            raise AdapterError("lora", "this engine serves no LoRA adapters: start it with --max-loras")
        return self.lora.load(path)

    def unload_lora(self, digest: str) -> None:
        if self.lora is not None:
            self.lora.unload(digest)

    def _activate_loras(self, out: SchedulerOutput) -> None:
        """Check the step's LoRA fields and copy into its slots the adapters they must hold."""
        if self.lora is None:
            check_step_slots(out, 0, lambda digest: False)
        else:
            self.lora.activate(out)

    def _check_group_geometry(self, hf_cfg: dict) -> list[RankMemory]:
        """Every rank must agree on the pool, the model and what its collectives depend on (the
        scheduler sees only rank 0's; ranks on other machines get their flags separately); returns
        every rank's memory figures."""
        cfg = self.model.config
        agree = {"KV blocks": self.num_kv_blocks, "max model length": self.max_model_len,
                 "vocabulary": cfg.vocab_size, "block size": self.block_size, "dtype": _code(self.config.dtype),
                 "attention backend": _code(self.model.attn.name), "enforce eager": int(self.config.enforce_eager),
                 "max num seqs": self.config.max_num_seqs, "LoRA slots": self.config.max_loras,
                 "max LoRA rank": self.config.max_lora_rank if self.config.max_loras else 0,
                 "model config": _code(json.dumps(hf_cfg, sort_keys=True))}
        mine = self.memory[0]
        rows = self.group.all_gather_ints([*agree.values(), mine.weight_bytes, mine.kv_cache_bytes, mine.start_bytes])
        n = len(agree)
        differ = [name for i, name in enumerate(agree) if len({r[i] for r in rows}) > 1]
        if differ:
            raise self.group.fail(f"the ranks disagree on {', '.join(differ)}: give every rank the same engine flags "
                                  f"and model")
        return [RankMemory(rank, *r[n:]) for rank, r in enumerate(rows)]

    def capture_decode_graphs(self, capture=None) -> DecodeGraphs | None:
        """Decode graphs for every batch size up to max_num_seqs (None where none can be captured:
        no capture given off CUDA, or a backend that reads the device on the host)."""
        attention = self.model.attn
        if self.model_path != MODULE_PATH:
            return None  # transformers' module tree runs eagerly
        if self.model.config.moe is not None:
            # The CPU expert path sizes its GEMMs from each step's routing (read on the host); CUDA graphs
            # would need the Triton kernel's worst-case padding in every captured size. Eager for now.
            log.info("no CUDA graphs: mixture-of-experts layers run eagerly")
            return None
        if capture is None:
            if self.device.type != "cuda":
                return None
            if not attention.backend.captures_graphs:
                log.info("no CUDA graphs: the %s attention backend reads the device on the host", attention.name)
                return None
            capture = CudaGraphCapture(self.device)
        return DecodeGraphs(self.model, self.kv_caches, attention, self.device, self.block_size,
                            graph_rows(self.config.max_num_seqs, self.config.speculative), self.max_model_len, capture,
                            self.lora.slots if self.lora is not None else None, self.kv_plan.num_groups)

    def reset(self) -> None:
        if self.drafter is not None:
            self.drafter.reset()
        if self.sender is not None:
            with self.group.exclusive("reset"):
                self.sender.send(Op.RESET)
                self.arena.zero_()
            return
        self.arena.zero_()

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel engine (nothing to do for a single process)."""
        if self.sender is not None:
            self.sender.shutdown()

    def _copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        # Every layer's keys and values at once: the arena's block axis is dimension 2.
        # (as bytes: PyTorch has no index_copy_ for float8 tensors; a copy is a copy)
        arena = self.arena.view(torch.uint8) if self.arena.dtype == torch.float8_e4m3fn else self.arena
        arena.index_copy_(2, dst, arena.index_select(2, src))

    def _metadata(self, step: StepInputs, t: StepTensors) -> list[AttentionMetadata]:
        """One AttentionMetadata per KV group: the group's slots and tables, everything else shared."""
        return [step.attention_metadata(t, self.model.attn, self.model.num_kv_heads, g)
                for g in range(self.kv_plan.num_groups)]

    def run_step(self, step: StepInputs) -> tuple[torch.Tensor | None, torch.Tensor] | None:
        """Copy-on-write, then the forward of a validated step: (logits of the sampled rows, final hidden
        state), or None when nothing is computed. On a tensor-parallel rank other than 0 the logits are
        None (they were gathered on rank 0). Call it under torch.inference_mode()."""
        if step.graph_batch is not None:
            logits, hidden = self.graphs.run(step)
        else:
            t = step.upload(self.device)
            if step.num_copies:
                self._copy_blocks(t.copy_src, t.copy_dst)
            if not step.num_tokens:
                return None
            lora = LoraBatch.of(self.lora.slots, step.lora_segments, self.device) if step.lora_segments else None
            logits, hidden = self.model.forward(t.input_ids, t.positions, self._metadata(step, t), self.kv_caches,
                                                t.sample_idx, lora)
        if self.group is not None and step.num_sampled:
            logits = self.model.gather_logits(logits[:step.num_sampled])
        return logits, hidden

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Raises InvalidStepError (naming the sequences) before touching the device for a bad step."""
        graphs = self.graphs
        self._activate_loras(out)
        step = self.inputs.build(out, graphs.batch_for if graphs is not None else None)
        result = ModelRunnerOutput(step_id=out.step_id)
        if self.sender is None:
            ran = self.run_step(step)
        else:
            with self.group.exclusive(f"step {out.step_id}"):
                self.sender.send_step(step)
                ran = self.run_step(step)
                self.group.wait_device(f"step {out.step_id}")
        rows = step.rows
        if ran is not None and rows:
            logits, hidden = ran
            n = len(rows)
            tokens, logprobs = self.sampler(logits[:n], rows, None if hidden is None else hidden[:n],
                                            self.model.head_weight)
            for seq_id, tok, lp in zip(step.owners, tokens, logprobs, strict=True):
                result.sampled.setdefault(seq_id, []).append(tok)
                if lp is not None:
                    result.logprobs.setdefault(seq_id, []).append(lp)
            if step.drafts:
                commit_verified(result, step.drafts)
        if self.drafter is not None:
            self.drafter.follow(out, result, step)  # its KV follows the committed tokens; proposals where asked
        if ran is not None and self.model_path == MODULE_PATH and self.model.config.moe is not None:
            result.expert_tokens = self.model.take_expert_tokens()
        return result
