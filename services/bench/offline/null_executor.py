"""An engine that computes nothing, to measure the scheduler's own CPU cost per step at scale."""

from __future__ import annotations

from services.contracts.step_protocol import EngineInfo, ModelRunnerOutput, SchedulerOutput


class NullExecutor:
    def __init__(self, num_blocks: int = 65536, block_size: int = 16, vocab_size: int = 49152):
        self.info = EngineInfo("null", block_size, num_blocks, 1 << 20, vocab_size, "none", "none", [])

    def handshake(self) -> EngineInfo:
        return self.info

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        res = ModelRunnerOutput(out.step_id)
        for s in out.sequences:
            if s.sample:
                res.sampled[s.seq_id] = [(s.token_ids[-1] * 31 + 7) % 40000 + 100] * s.num_samples
        return res

    def reset(self) -> None:
        pass

    def health(self) -> bool:
        return True

    def close(self) -> None:
        pass


def scheduler_ms_per_step(tokenizer, num_running: int = 256, prompt_len: int = 256, steps: int = 200) -> float:
    """Median scheduler CPU time per decode step with `num_running` sequences (engine cost excluded)."""
    import statistics
    import time

    from services.request.sampling_params import SamplingParams
    from services.scheduler.core import SchedulerCore

    core = SchedulerCore(NullExecutor(), tokenizer, max_num_seqs=num_running, max_num_batched_tokens=1 << 16)
    params = SamplingParams(temperature=0, max_tokens=steps + 10, ignore_eos=True)
    for i in range(num_running):
        core.add_request(f"r{i}", [(i * 7 + j) % 40000 + 100 for j in range(prompt_len)], params)
    core.step()  # all prefills
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - t)
    assert len(core.scheduler.running) == num_running
    return 1000 * statistics.median(times)
