"""Memory saved by sharing KV blocks between the sequences of one request (the vLLM paper's Figure 15).

Parallel sampling (`n` samples share the prompt's blocks, copy-on-write at the first divergent write)
and beam search (beams share the prompt and their common history) run on pagedserve's real engine.
After every step the pool's blocks in use (each shared block once) are set against the blocks the same
sequences would hold with no sharing (each sequence its own copy of every block in its table); the saving
is 1 - in use / unshared, summed over all steps, in percent.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.bench.paper.workloads import TraceRequest


@dataclass
class SharingCounter:
    in_use: int = 0
    unshared: int = 0

    def observe(self, core) -> None:
        self.in_use += core.pool.num_in_use
        self.unshared += core.kv.num_blocks_unshared()

    @property
    def saving_percent(self) -> float:
        return 100.0 * (1 - self.in_use / self.unshared) if self.unshared else 0.0


def _measure(llm, run) -> float:
    counter = SharingCounter()
    llm.step_hook = counter.observe
    try:
        run()
    finally:
        llm.step_hook = None
    if llm.core.pool.num_in_use:
        raise RuntimeError(f"{llm.core.pool.num_in_use} blocks still held after the sharing run")
    return counter.saving_percent


def parallel_sampling_saving(llm, trace: list[TraceRequest], n: int, seed: int = 0) -> float:
    from services import SamplingParams

    params = [SamplingParams(n=n, temperature=1.0, seed=seed + i, max_tokens=r.output_len, ignore_eos=True)
              for i, r in enumerate(trace)]
    return _measure(llm, lambda: llm.generate([r.prompt_token_ids for r in trace], params, use_tqdm=False))


def beam_search_saving(llm, trace: list[TraceRequest], width: int) -> float | None:
    """None when this build has no beam search."""
    if not hasattr(llm, "beam_search"):
        return None
    from services import BeamSearchParams

    # Beam search runs one length for all prompts in vLLM's API: the trace's mean output length.
    max_tokens = max(1, round(sum(r.output_len for r in trace) / len(trace)))
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True)
    return _measure(llm, lambda: llm.beam_search([r.prompt_token_ids for r in trace], params))
