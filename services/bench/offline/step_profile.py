"""`bench throughput --profile`: where each step's time goes, for the offline workloads.

Wraps (for the profiled run only, restored afterwards) the engine's pieces with wall-clock timers:
building the step's inputs, the linears (the four per layer, and the output head apart), the attention
backend's KV write, decode attention and prefill attention, the sampler; the rest of the forward
(embedding, norms, rotary, activation) and of the engine's step are what is left. The scheduler's share
of a step is the step minus the engine's execution; the engine is idle between steps for exactly that
long in the offline loop. Per step it records tokens (decode and prefill), prefix-hit tokens of the
requests admitted, and running requests; the report sums them over step kinds (decode-only, mixed,
prefill-only). CPU kernels run synchronously on the calling thread's clock, so wall-clock timers around
them are exact; the wrappers themselves cost about a microsecond per call (reported).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

PARTS = ("inputs", "gemm", "lm_head", "kv_write", "decode_attention", "prefill_attention", "sampling")


@dataclass
class StepRecord:
    kind: str  # decode, mixed, prefill
    tokens: int
    decode_tokens: int
    prefill_tokens: int
    prefix_hit_tokens: int
    running: int
    step_s: float
    execute_s: float
    forward_s: float
    parts: dict[str, float]


class _Timed:
    """Calls `inner` and adds its wall time to the profiler's `part`; any other attribute is the inner
    object's (the engine reads an expert layer's counters and a linear's fields between calls)."""

    __slots__ = ("_inner", "_part", "_profiler")

    def __init__(self, inner, part: str, profiler: StepProfiler):
        self._inner, self._part, self._profiler = inner, part, profiler

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return self._inner(*args, **kwargs)
        finally:
            self._profiler._acc[self._part] += time.perf_counter() - t
            self._profiler.wrapped_calls += 1

    def __getattr__(self, name):
        return getattr(self._inner, name)


@dataclass
class StepProfiler:
    records: list[StepRecord] = field(default_factory=list)
    wrapped_calls: int = 0
    _acc: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    _restore: list = field(default_factory=list)
    _last_hits: int = 0
    _exec: list[float] = field(default_factory=lambda: [0.0, 0.0])  # execute, forward

    def _timed(self, fn, part: str):
        return _Timed(fn, part, self)

    def _patch(self, obj, name: str, part: str) -> None:
        # An attribute of the instance (its __dict__ or a slot) is put back; a method found on the class is
        # restored by deleting the wrapper.
        had = name in vars(obj) if hasattr(obj, "__dict__") else True
        orig = getattr(obj, name)
        setattr(obj, name, self._timed(orig, part))
        self._restore.append((obj, name, orig if had else None))

    def attach(self, llm) -> None:
        """Wrap the pieces of `llm`'s in-process engine (rank 0: the only one with tensor parallelism 1)."""
        runner = llm.runner
        model = runner.model
        backend = model.attn.backend
        self._patch(runner.inputs, "build", "inputs")
        self._patch(backend, "write_kv", "kv_write")
        self._patch(backend, "decode", "decode_attention")
        self._patch(backend, "prefill", "prefill_attention")
        for layer in model.layers:
            # The dense attention and MLP linears, and an expert layer as a whole (its router, grouped GEMMs
            # and scatter count as GEMMs). A part a family lacks is None. MLA's projections stay in "the
            # rest": its module calls attention in the middle, which is timed apart.
            for name in ("qkv", "o", "gate_up", "down", "moe"):
                if getattr(layer, name, None) is not None:
                    self._patch(layer, name, "gemm")
        self._patch(model, "lm_head", "lm_head")
        self._patch(runner, "sampler", "sampling")
        exec_acc = self._exec
        inner_exec, inner_fwd = runner.execute, model.forward

        def execute(out):
            t = time.perf_counter()
            try:
                return inner_exec(out)
            finally:
                exec_acc[0] += time.perf_counter() - t

        def forward(*args, **kwargs):
            t = time.perf_counter()
            try:
                return inner_fwd(*args, **kwargs)
            finally:
                exec_acc[1] += time.perf_counter() - t

        runner.execute = execute
        model.forward = forward
        self._restore += [(runner, "execute", None), (model, "forward", None)]
        self._last_hits = llm.core.kv.prefix_hits

    def detach(self) -> None:
        for obj, name, orig in reversed(self._restore):
            if orig is None:
                delattr(obj, name)
            else:
                setattr(obj, name, orig)
        self._restore.clear()

    def observe(self, core, step_s: float) -> None:
        """After each step (the LLM's step hook): file what it scheduled and what it cost."""
        out = core.last_output
        seqs = out.sequences if out is not None else []
        decode = sum(1 for s in seqs if len(s.token_ids) == 1)
        tokens = sum(len(s.token_ids) for s in seqs)
        prefill = tokens - decode
        kind = "decode" if not prefill else ("prefill" if not decode else "mixed")
        hits = core.kv.prefix_hits
        self.records.append(StepRecord(kind, tokens, decode, prefill, hits - self._last_hits,
                                       len(core.scheduler.running), step_s, self._exec[0], self._exec[1],
                                       dict(self._acc)))
        self._last_hits = hits
        self._acc.clear()
        self._exec[0] = self._exec[1] = 0.0

    def summary(self) -> dict:
        """Per step kind and over all steps: counts, tokens, and milliseconds per step of each part."""
        groups: dict[str, list[StepRecord]] = defaultdict(list)
        for r in self.records:
            groups[r.kind].append(r)
            groups["all"].append(r)
        out = {}
        for kind in ("decode", "mixed", "prefill", "all"):
            rs = groups.get(kind)
            if not rs:
                continue
            n = len(rs)
            total = sum(r.step_s for r in rs)
            ms = {p: 1000 * sum(r.parts.get(p, 0.0) for r in rs) / n for p in PARTS}
            forward = 1000 * sum(r.forward_s for r in rs) / n
            execute = 1000 * sum(r.execute_s for r in rs) / n
            inside = sum(ms[p] for p in ("gemm", "lm_head", "kv_write", "decode_attention", "prefill_attention"))
            ms["forward_other"] = forward - inside  # embedding, norms, rotary, activation, residual adds
            ms["engine_other"] = execute - forward - ms["inputs"] - ms["sampling"]
            ms["scheduler"] = 1000 * total / n - execute  # the engine's idle gap before the next step
            out[kind] = {
                "steps": n, "seconds": round(total, 3), "share_of_time": round(total / max(1e-9, sum(
                    r.step_s for r in self.records)), 3),
                "tokens_per_step": round(sum(r.tokens for r in rs) / n, 1),
                "decode_tokens_per_step": round(sum(r.decode_tokens for r in rs) / n, 1),
                "prefill_tokens_per_step": round(sum(r.prefill_tokens for r in rs) / n, 1),
                "prefix_hit_tokens": sum(r.prefix_hit_tokens for r in rs),
                "running_per_step": round(sum(r.running for r in rs) / n, 1),
                "ms_per_step": round(1000 * total / n, 3),
                "ms_per_step_by_part": {k: round(v, 3) for k, v in ms.items()},
            }
        out["wrapped_calls_per_step"] = round(self.wrapped_calls / max(1, len(self.records)), 1)
        return out


def print_summary(summary: dict) -> None:
    cols = ("scheduler", "inputs", "gemm", "lm_head", "prefill_attention", "decode_attention", "kv_write",
            "forward_other", "sampling", "engine_other")
    print(f"\nprofile (ms per step; wrappers: {summary['wrapped_calls_per_step']} timed calls per step)")
    print(f"{'steps':<8}{'n':>5}{'share':>7}{'tok/st':>8}{'pre/st':>8}{'hits':>7}{'ms/st':>8}"
          + "".join(f"{c[:9]:>10}" for c in cols))
    for kind in ("decode", "mixed", "prefill", "all"):
        s = summary.get(kind)
        if s is None:
            continue
        p = s["ms_per_step_by_part"]
        print(f"{kind:<8}{s['steps']:>5}{100 * s['share_of_time']:>6.0f}%{s['tokens_per_step']:>8.0f}"
              f"{s['prefill_tokens_per_step']:>8.0f}{s['prefix_hit_tokens']:>7}{s['ms_per_step']:>8.2f}"
              + "".join(f"{p[c]:>10.2f}" for c in cols))
