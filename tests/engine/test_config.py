"""EngineConfig is how every command builds an engine: the attention backend, --enforce-eager, the
largest captured batch and tensor parallelism reach it from `engine`, `serve`, `up` (to its engine
processes), env vars and LLM(...); a config survives its own flags (how rank 0 starts its ranks); bad
settings and a split the model cannot take are refused with the reason; the engine image's default
command runs the Triton backend with CUDA graphs on the GPU."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from services import LLM, SamplingParams
from services.commands.cli import build_parser
from services.commands.up import LocalCluster
from services.engine.config import EngineConfig

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("command", ["engine", "serve"])
def test_engine_flags_reach_the_config(command):
    args = build_parser().parse_args([command, "--attention-backend", "reference", "--enforce-eager",
                                      "--max-num-seqs", "48"])
    config = EngineConfig.from_args(args)
    assert (config.attention_backend, config.enforce_eager, config.max_num_seqs) == ("reference", True, 48)
    defaults = EngineConfig.from_args(build_parser().parse_args([command]))
    assert (defaults.attention_backend, defaults.enforce_eager, defaults.max_num_seqs) == ("auto", False, 256)


def test_env_vars_set_them_too(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_ATTENTION_BACKEND", "triton")
    monkeypatch.setenv("PAGEDSERVE_ENFORCE_EAGER", "true")
    config = EngineConfig.from_args(build_parser().parse_args(["engine"]))
    assert config.attention_backend == "triton" and config.enforce_eager


def test_up_passes_them_to_its_engines():
    args = build_parser().parse_args(["up", "--attention-backend", "cpu", "--enforce-eager", "--max-num-seqs", "8",
                                      "--redis-url", "redis://127.0.0.1:1/0"])
    cluster = LocalCluster(args, replicas=2, routers=1)
    cluster._plan()
    for engine in cluster.engines:
        argv = engine.argv
        assert argv[argv.index("--attention-backend") + 1] == "cpu"
        assert "--enforce-eager" in argv and argv[argv.index("--max-num-seqs") + 1] == "8"
        parsed = build_parser().parse_args(argv[argv.index("engine"):])
        assert EngineConfig.from_args(parsed).attention_backend == "cpu"


def test_the_engine_image_starts_triton_with_cuda_graphs(monkeypatch):
    """The CUDA image (ENGINE_DEVICE's default) starts on the GPU with Triton and CUDA graphs; the CPU
    image on the CPU with the C++ kernels: the device comes from PAGEDSERVE_DEVICE, which the image's ENV
    sets from ENGINE_DEVICE."""
    import torch

    from services.engine.attention import resolve_backend

    text = (REPO / "docker" / "engine.Dockerfile").read_text()
    argv = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))
    assert re.search(r"^ARG ENGINE_DEVICE=cuda$", text, re.M)
    final = text[text.rindex("\nFROM "):]
    assert re.search(r"^\s+PAGEDSERVE_DEVICE=\$\{ENGINE_DEVICE\} \\$", final, re.M)
    for device, backend in (("cuda", "triton"), ("cpu", "cpu")):
        monkeypatch.setenv("PAGEDSERVE_DEVICE", device)
        config = EngineConfig.from_args(build_parser().parse_args(argv))
        assert (config.device, config.enforce_eager) == (device, False)
        assert resolve_backend(config.attention_backend, torch.device(device)) == backend
    assert "assert torch.version.cuda" in text, "the build refuses a CPU-only torch"


def test_offline_api_takes_the_backend(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=16, attention_backend="reference",
              enforce_eager=True, max_num_seqs=4)
    assert llm.runner.model.attn.name == "reference" and llm.runner.config.max_num_seqs == 4
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match="attention_backend"):
        LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=16, attention_backend="flash")



@pytest.mark.parametrize("command", ["engine", "serve"])
def test_tensor_parallel_flags_reach_the_config(command):
    config = EngineConfig.from_args(build_parser().parse_args([command, "--tensor-parallel-size", "4",
                                                               "--tp-timeout", "7.5"]))
    assert (config.tensor_parallel_size, config.tp_timeout) == (4, 7.5)
    assert EngineConfig.from_args(build_parser().parse_args([command])).tensor_parallel_size == 1


def test_up_starts_tensor_parallel_engines(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_TENSOR_PARALLEL_SIZE", "2")
    args = build_parser().parse_args(["up", "--redis-url", "redis://127.0.0.1:1/0"])
    cluster = LocalCluster(args, replicas=1, routers=1)
    cluster._plan()
    argv = cluster.engines[0].argv
    parsed = build_parser().parse_args(argv[argv.index("engine"):])
    assert EngineConfig.from_args(parsed).tensor_parallel_size == 2


def test_a_config_survives_its_flags_and_ranks_parse_them():
    config = EngineConfig(model="/m", dtype="float32", device="cpu", block_size=32, num_kv_blocks=99,
                          kv_cache_memory=123456, max_model_len=300, attention_backend="reference", enforce_eager=True,
                          max_num_seqs=3, load_format="random", tensor_parallel_size=4, tp_local_ranks=2,
                          tp_rendezvous="tcp://leader:29500", tp_timeout=9.0)
    # A worker is a rank other than 0: the parser refuses engine-worker as rank 0 (flag_rules.engine_config).
    for command in (["engine"], ["engine-worker", "--tp-node-rank", "1"]):
        assert EngineConfig.from_args(build_parser().parse_args([*command, *config.as_flags()])) == config
    worker = build_parser().parse_args(["engine-worker", "--tp-node-rank", "1", *config.as_flags()])
    assert (worker.tp_node_rank, worker.tp_local_rank) == (1, 0) and not hasattr(worker, "port")


@pytest.mark.parametrize("bad, match", [(dict(tensor_parallel_size=0), "tensor_parallel_size"),
                                        (dict(tensor_parallel_size=4, tp_local_ranks=3), "tp_local_ranks"),
                                        (dict(tp_timeout=0), "tp_timeout"), (dict(load_format="dummy"), "load_format")])
def test_bad_tensor_parallel_settings_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**bad)


def test_the_engine_command_refuses_a_split_the_model_cannot_take():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "services.commands.cli", "engine", "--tensor-parallel-size", "2",
                           "--dtype", "float32"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.strip().endswith("pagedserve engine: tensor_parallel_size 2 does not divide the model's 9 "
                                        "attention heads (every rank must hold whole heads); sizes that fit this "
                                        "model: 1, 3"), proc.stderr[-2000:]
