"""The offline API, shaped like vLLM's: `LLM(...).generate(prompts, params)` and `.chat(...)`.

Runs the engine core and a model runner in this process (with tensor_parallel_size N, rank 0 here
and the other ranks in child processes); every prompt is validated before any is queued, so one bad
prompt fails the call without leaving half a batch behind.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tqdm import tqdm

from services.contracts.byte_size import parse_bytes
from services.contracts.speculative_config import SpeculativeConfig
from services.engine.config import EngineConfig
from services.model_files.tokenizer import ModelTokenizer
from services.request.beam_search_params import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from services.request.errors import InvalidRequestError
from services.request.sampling_params import SamplingParams
from services.scheduler.core import SchedulerCore
from services.scheduler.executor import InProcessExecutor
from services.scheduler.request_output import RequestOutput


class LLM:
    def __init__(self, model: str | None = None, dtype: str = "bfloat16", block_size: int = 16,
                 num_kv_blocks: int | None = None, max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
                 enable_prefix_caching: bool = True, device: str = "auto", kv_cache_memory: str | int = "4G",
                 max_model_len: int | None = None, attention_backend: str = "auto", enforce_eager: bool = False,
                 tensor_parallel_size: int = 1, tp_timeout: float = 60.0, serving_system: str = "pagedserve",
                 max_loras: int = 0, max_lora_rank: int = 16, max_cpu_loras: int | None = None,
                 speculative_config: dict | str | None = None, quantization: str | None = None,
                 kv_cache_dtype: str = "auto"):
        """`speculative_config`: vLLM's, e.g. {"method": "ngram", "num_speculative_tokens": 4,
        "prompt_lookup_max": 4, "prompt_lookup_min": 2} (services.contracts.speculative_config)."""
        from services.engine.tp_launch import start_runner

        spec = SpeculativeConfig.parse(speculative_config)  # refused before minutes of loading

        # tensor_parallel_size > 1: this process is rank 0 and starts the other ranks as child processes.
        self.runner = start_runner(EngineConfig(
            model=model, dtype=dtype, device=device, block_size=block_size, num_kv_blocks=num_kv_blocks,
            kv_cache_memory=parse_bytes(kv_cache_memory), max_model_len=max_model_len,
            attention_backend=attention_backend, enforce_eager=enforce_eager, max_num_seqs=max_num_seqs,
            tensor_parallel_size=tensor_parallel_size, tp_timeout=tp_timeout, max_loras=max_loras,
            max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras,
            speculative_config=spec.to_json() if spec is not None else None, quantization=quantization,
            kv_cache_dtype=kv_cache_dtype))
        self.tokenizer = ModelTokenizer(self.runner.model_dir)
        self.core = SchedulerCore(InProcessExecutor(self.runner), self.tokenizer, max_num_seqs=max_num_seqs,
                                 max_num_batched_tokens=max_num_batched_tokens,
                                 enable_prefix_caching=enable_prefix_caching, max_model_len=max_model_len,
                                 serving_system=serving_system, speculative_config=spec)
        self._ids = itertools.count()
        self.step_hook = None  # called after every step (benchmarks read KV efficiency through it)

    def close(self) -> None:
        """Stop the engine's other tensor-parallel ranks (they also stop when this object is collected or
        the interpreter exits); a single-process engine holds nothing to stop."""
        self.runner.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _to_token_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", "must not be empty")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            prompt = prompt["prompt_token_ids"]
        elif isinstance(prompt, dict) and "prompt" in prompt:
            return self._to_token_ids(prompt["prompt"])
        if not isinstance(prompt, (list, tuple)):
            raise InvalidRequestError("prompt", f"must be a string or a list of token ids, got {type(prompt).__name__}")
        return list(prompt)

    def load_lora(self, name: str, path: str):
        """Load (or reload) the PEFT adapter in directory `path` under `name` (trusted: any path)."""
        return self.core.load_lora(name, path)

    def unload_lora(self, name: str):
        return self.core.unload_lora(name)

    def generate(self, prompts: str | Sequence, params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: str | Sequence[str | None] | None = None) -> list[RequestOutput]:
        """`lora_request`: the name of a loaded adapter for every prompt, or one name (None: the base model)
        per prompt."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} SamplingParams for {len(prompts)} prompts")
        names = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(names) != len(prompts):
            raise ValueError(f"{len(names)} lora_request names for {len(prompts)} prompts")
        for n in names:
            if n is not None and self.core.loras.get(n) is None:
                raise InvalidRequestError("lora_request", f"no adapter named {n!r} is loaded")
        token_lists = [self._to_token_ids(p) for p in prompts]
        for ids, p in zip(token_lists, plist, strict=True):
            self.core.validate(ids, p)
        # Structured output: every constraint compiles (in parallel, cached) before any prompt is queued.
        for p in plist:
            if p.structured_outputs is not None:
                self.core.grammars.submit(p.structured_outputs)
        grammars = [None if p.structured_outputs is None else self.core.grammars.compile(p.structured_outputs)
                    for p in plist]
        rids = []
        for ids, p, grammar, name in zip(token_lists, plist, grammars, names, strict=True):
            rid = f"offline-{next(self._ids)}"
            self.core.add_request(rid, ids, p, validated=True, grammar=grammar, lora_name=name)
            rids.append(rid)
        return self._run(rids, use_tqdm)

    def beam_search(self, prompts: str | Sequence, params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's offline beam search: prompts as strings, token lists or {"prompt": ...} /
        {"prompt_token_ids": ...} dicts; one BeamSearchOutput per prompt, its best `beam_width` beams first.
        Every prompt's beams run together in the continuous batch, sharing KV blocks."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        results = self.generate([self._to_token_ids(p) for p in prompts], params.to_sampling_params(), use_tqdm)
        outputs = []
        for res in results:
            beams = []
            for c in res.outputs:
                tokens = res.prompt_token_ids + c.token_ids
                beams.append(BeamSearchSequence(
                    tokens, c.logprobs or [], c.cumulative_logprob or 0.0, self.tokenizer.decode(tokens, False),
                    c.finish_reason, c.stop_reason, c.token_ids, c.text))
            outputs.append(BeamSearchOutput(beams))
        return outputs

    def chat(self, conversations: list[list[dict]] | list[dict],
             params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """`chat_template_kwargs`: extra template variables, e.g. {"enable_thinking": False} for Qwen3."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [self.tokenizer.apply_chat_template(msgs, template_kwargs=chat_template_kwargs)
                   for msgs in conversations]
        return self.generate(prompts, params, use_tqdm)

    def _run(self, rids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        wanted = set(rids)
        bar = tqdm(total=len(rids), desc="generating", unit="req", disable=not use_tqdm)
        try:
            while len(done) < len(rids):
                for out in self.core.step():
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        bar.update(1)
                if self.step_hook is not None:
                    self.step_hook(self.core)
        except BaseException:
            for rid in rids:
                if rid not in done:
                    self.core.abort_request(rid)
            raise
        finally:
            bar.close()
        return [done[r] for r in rids]
