"""The engine service as a real process (`pagedserve engine`, tiny random Llama), driven by the engine
core over the step protocol: same tokens as the in-process engine, prefix hits, and restart detection."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from services.commands.ports import free_port
from services.model_files.tokenizer import ModelTokenizer
from services.request.sampling_params import SamplingParams
from services.scheduler.core import SchedulerCore
from services.scheduler.executor import InProcessExecutor
from services.transport import EngineUnavailableError, RemoteExecutor


def start_engine(model_dir, port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "services.commands.cli", "engine", "--host", "127.0.0.1", "--port",
                             str(port), "--model", str(model_dir), "--dtype", "float32", "--device", "cpu",
                             "--num-kv-blocks", "64", "--log-level", "warning"])


def run_to_end(core: SchedulerCore, prompts: list[list[int]], params: SamplingParams,
               lora_names: list[str | None] | None = None) -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        core.add_request(f"r{i}", p, params, lora_name=lora_names[i] if lora_names else None)
    done = {}
    while core.has_unfinished():
        for out in core.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done


@pytest.fixture(scope="module")
def engine_process(tiny_llama_dir):
    port = free_port()
    proc = start_engine(tiny_llama_dir, port)
    yield proc, port
    proc.terminate()
    proc.wait(10)


def test_remote_engine_matches_in_process_engine(tiny_llama_dir, engine_process):
    from services.engine.config import EngineConfig
    from services.engine.model_runner import ModelRunner

    _, port = engine_process
    tok = ModelTokenizer(tiny_llama_dir)
    prompts = [tok.encode("The quick brown fox " * 5), tok.encode("Hello"), tok.encode("The quick brown fox " * 6)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    remote = RemoteExecutor(f"tcp://127.0.0.1:{port}", timeout=60)
    remote.wait_ready(120)
    got = run_to_end(SchedulerCore(remote, tok, collect_kv_events=True), prompts, params)
    runner = ModelRunner(EngineConfig(str(tiny_llama_dir), dtype="float32", device="cpu", num_kv_blocks=64))
    want = run_to_end(SchedulerCore(InProcessExecutor(runner), tok), prompts, params)
    assert got == want and len(got["r0"]) == 8
    remote.close()


def test_engine_sigterm_exits_cleanly_and_restart_is_a_new_instance(tiny_llama_dir):
    port = free_port()
    proc = start_engine(tiny_llama_dir, port)
    ex = RemoteExecutor(f"tcp://127.0.0.1:{port}", timeout=30)
    try:
        ex.wait_ready(120)
        first = ex.probe()
        assert first == ex.instance
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(10) == 0
        assert ex.probe(0.5) is None
        proc = start_engine(tiny_llama_dir, port)
        deadline = time.monotonic() + 120
        while (instance := ex.probe(0.5)) is None:
            assert time.monotonic() < deadline
        assert instance != first
        with pytest.raises(EngineUnavailableError, match="restarted"):
            ex.reset()
    finally:
        ex.close()
        proc.kill()
        proc.wait(10)
