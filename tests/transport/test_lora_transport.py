"""LoRA over the step protocol: a scheduler loads an adapter into a remote engine process, its requests
match the in-process engine's, and a bad adapter comes back as an AdapterError naming its field."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.commands.ports import free_port
from services.model_files.lora_files import AdapterError
from services.model_files.tokenizer import ModelTokenizer
from services.request.sampling_params import SamplingParams
from services.scheduler.core import SchedulerCore
from services.scheduler.executor import InProcessExecutor
from services.transport import RemoteExecutor
from tests.engine.lora_adapters import save_random_adapter
from tests.transport.test_engine_server import run_to_end


def _run(core, prompts, names):
    return run_to_end(core, prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), names)


def test_remote_engine_loads_and_serves_adapters(tiny_llama_dir, tmp_path):
    from services.engine.config import EngineConfig
    from services.engine.model_runner import ModelRunner

    adapter = save_random_adapter(tiny_llama_dir, tmp_path / "A", seed=5)
    big = save_random_adapter(tiny_llama_dir, tmp_path / "big", seed=6, rank=16)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "services.commands.cli", "engine", "--host", "127.0.0.1", "--port",
                             str(port), "--model", str(tiny_llama_dir), "--dtype", "float32", "--device", "cpu",
                             "--num-kv-blocks", "64", "--max-loras", "1", "--max-lora-rank", "8",
                             "--log-level", "warning"])
    try:
        remote = RemoteExecutor(f"tcp://127.0.0.1:{port}", timeout=60)
        remote.wait_ready(120)
        tok = ModelTokenizer(tiny_llama_dir)
        core = SchedulerCore(remote, tok)
        assert core.load_lora("A", str(adapter)).rank == 8
        with pytest.raises(AdapterError) as e:
            core.load_lora("big", str(big))
        assert e.value.field == "r"
        prompts = [tok.encode("The quick brown fox " * 3), tok.encode("Hello there")]
        got = _run(core, prompts * 2, ["A", "A", None, None])
        runner = ModelRunner(EngineConfig(str(tiny_llama_dir), dtype="float32", device="cpu", num_kv_blocks=64,
                                          max_loras=1, max_lora_rank=8))
        local = SchedulerCore(InProcessExecutor(runner), tok)
        local.load_lora("A", str(adapter))
        assert got == _run(local, prompts * 2, ["A", "A", None, None])
        assert got["r0"] != got["r2"], "the adapter changes the output"
        remote.close()
    finally:
        proc.terminate()
        proc.wait(10)
