"""EngineConfig is how every command builds an engine: the attention backend, --enforce-eager and the
largest captured batch reach it from `engine`, `serve`, `up` (to its engine processes), env vars and
LLM(...); the engine image's default command runs the Triton backend with CUDA graphs on the GPU."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from services import LLM, SamplingParams
from services.cli import build_parser
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


def test_the_engine_image_starts_triton_with_cuda_graphs():
    text = (REPO / "docker" / "engine.Dockerfile").read_text()
    argv = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))
    config = EngineConfig.from_args(build_parser().parse_args(argv))
    assert (config.device, config.attention_backend, config.enforce_eager) == ("cuda", "triton", False)
    assert "assert torch.version.cuda" in text, "the build refuses a CPU-only torch"


def test_offline_api_takes_the_backend(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=16, attention_backend="reference",
              enforce_eager=True, max_num_seqs=4)
    assert llm.runner.model.attn.name == "reference" and llm.runner.config.max_num_seqs == 4
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match="attention_backend"):
        LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=16, attention_backend="flash")

