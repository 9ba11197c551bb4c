"""The servers `bench serve` starts and stops itself: pagedserve (`serve` or `up`) and vLLM's OpenAI
server, with the same model files, dtype, KV cache memory, max model length and thread binding."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from services.contracts.byte_size import parse_bytes

REPO = Path(__file__).resolve().parents[3]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
START_TIMEOUT = 900.0


class StartedServer:
    """A server process this command owns: started, waited for, stopped (its log kept for failures)."""

    def __init__(self, name: str, argv: list[str], env: dict, url: str, log_path: Path):
        self.name, self.url, self.log_path = name, url, log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(argv, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_ready(self, timeout: float = START_TIMEOUT) -> str:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log_path}")
            try:
                models = httpx.get(self.url + "/v1/models", timeout=2).json().get("data") or []
                if models:
                    return models[0]["id"]
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not ready after {timeout:.0f}s; see {self.log_path}")
            time.sleep(1.0)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self._log.close()


def pagedserve_server(mode: str, args, port: int, log_dir: Path, extra: list[str] | None = None,
                      log_name: str | None = None) -> StartedServer:
    argv = [sys.executable, "-m", "services.commands.cli", mode, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", args.dtype, "--kv-cache-memory", args.kv_cache_memory, "--max-model-len",
            str(args.max_model_len), "--log-level", "warning", *(extra or [])]
    if args.model:
        argv += ["--model", args.model]
    if mode == "up":
        argv += ["--replicas", "1"]
    return StartedServer(f"pagedserve {mode}", argv, dict(os.environ), f"http://127.0.0.1:{port}",
                         log_dir / f"{log_name or f'pagedserve-{mode}'}.log")


def vllm_server(args, port: int, model_dir: Path, served_name: str, log_dir: Path) -> StartedServer:
    if not VLLM_PYTHON.exists():
        raise RuntimeError("vLLM's virtualenv is missing: run `make vllm-env` first")
    cores = os.cpu_count() or 1
    kv_gib = max(1, round(parse_bytes(args.kv_cache_memory) / 2**30))
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_PROC_BIND", "OMP_PLACES")}
    env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{cores - 1}", VLLM_CPU_KVCACHE_SPACE=str(kv_gib),
               VLLM_TARGET_DEVICE="cpu")
    argv = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", served_name, "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
            "--enable-prefix-caching", "--host", "127.0.0.1", "--port", str(port), "--seed", "0"]
    return StartedServer("vllm", argv, env, f"http://127.0.0.1:{port}", log_dir / "vllm.log")
