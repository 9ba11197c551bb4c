"""Shared fixtures with real parts: a real `redis-server` on a free port, and a tiny random Llama model
that uses the real SmolLM2 tokenizer (so chat templates and detokenization are the real thing)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from services.commands.ports import free_port
from services.commands.redis_binary import find_redis_server, missing_message

# Triton kernels (kernel tests, the engine on its Triton backend) run through Triton's CPU interpreter.
# It must be on before any kernel is defined: here, before any test module imports `kernels.triton_*`
# (the `kernels` package itself never imports Triton). Engines started by tests inherit it; their
# default CPU backend does not use Triton.
os.environ.setdefault("TRITON_INTERPRET", "1")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "chat_template.jinja", "generation_config.json")


class RedisServer:
    """A real redis-server child process; stop() and start() again simulate an outage on one port."""

    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> RedisServer:
        exe = find_redis_server()
        if exe is None:
            pytest.fail(missing_message())
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None

    def flush(self) -> None:
        import redis

        redis.Redis.from_url(self.url).flushall()


@pytest.fixture(scope="session", autouse=True)
def cpu_kernels_built():
    """Build the C++ CPU kernels once, up front: engine processes started by the tests then load the
    cached build instead of several of them compiling it at once against their start-up deadlines."""
    from kernels.cpu import load

    load()


@pytest.fixture(scope="session")
def redis_session():
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture
def redis_server(redis_session):
    """The session's redis-server, emptied for this test."""
    if redis_session.proc is None or redis_session.proc.poll() is not None:
        redis_session.start()
    redis_session.flush()
    return redis_session


@pytest.fixture(scope="session")
def redis_cluster_session():
    """A real local Redis Cluster: 3 shards of a primary and a replica each."""
    from services.commands.redis_cluster import LocalRedisCluster

    cluster = LocalRedisCluster(3).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def redis_cluster(redis_cluster_session):
    """The session's cluster, emptied for this test."""
    from redis.cluster import RedisCluster

    cluster = redis_cluster_session
    client = RedisCluster(host="127.0.0.1", port=cluster.ports[0], password=cluster.password)
    client.flushall(target_nodes=RedisCluster.PRIMARIES)
    client.close()
    return redis_cluster_session


@pytest.fixture
def private_redis():
    """A redis-server of this test alone (for tests that stop it)."""
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A 2-layer random Llama in float32 with SmolLM2's tokenizer and chat template (fast on CPU)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from services.model_files.model_source import resolve_model

    src = resolve_model(None)
    out = tmp_path_factory.mktemp("tiny-llama")
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    tok = AutoTokenizer.from_pretrained(str(src))
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, torch_dtype="float32")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


class AppServer:
    """An ASGI app served by a real uvicorn on a free loopback port, in a background thread."""

    def __init__(self, app, port: int | None = None):
        import uvicorn

        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="on"))
        self.thread = None

    def __enter__(self) -> AppServer:
        import threading

        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="session")
def smol_tokenizer():
    """The real SmolLM2 tokenizer (chat template included)."""
    from services.model_files.model_source import resolve_model
    from services.model_files.tokenizer import ModelTokenizer

    return ModelTokenizer(resolve_model(None))


@pytest.fixture(scope="session")
def hf_smol_tokenizer():
    """transformers' own tokenizer of SmolLM2: what ModelTokenizer must agree with."""
    from transformers import AutoTokenizer

    from services.model_files.model_source import resolve_model

    return AutoTokenizer.from_pretrained(str(resolve_model(None)))
