"""Command-line flags and environment variables of every pagedserve service, in one place.

This table is the single source of truth: the CLI builds its argument parsers from it, the local
cluster command (`pagedserve up`) passes flags from it, and the Helm chart's tests check that every
flag and env var the chart sets appears here. Each option may be given as a flag or through its env
var (flag wins); env vars are how Kubernetes Secrets reach a process.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

from services.commands import flag_values as V


@dataclass(frozen=True)
class Option:
    flag: str  # e.g. "--redis-url"
    help: str
    type: Any = str
    default: Any = None
    choices: tuple[str, ...] | None = None
    is_switch: bool = False  # boolean flag with a --no-... twin
    nargs: str | None = None  # "+": several values (the env var holds them separated by spaces)
    secret: bool = False  # never echoed in an error (a password, a key, a token)

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def env(self) -> str:
        return "PAGEDSERVE_" + self.dest.upper()


def speculative_json(text: str) -> str:
    """A --speculative-config value, checked when the flag is parsed (the error names the key)."""
    from services.contracts.speculative_config import SpeculativeConfig

    SpeculativeConfig.parse(text)  # raises ValueError: argparse reports it against the flag
    return text


speculative_json.__name__ = "speculative config (JSON)"

HOST = Option("--host", "address to listen on", default="0.0.0.0")
# The engine takes steps from its own scheduler only: loopback unless told otherwise (and then a token).
ENGINE_HOST = Option("--host", "address to listen on (beyond loopback only with an internal token)",
                     default="127.0.0.1")
MODEL = Option("--model", "Hugging Face directory or .gguf file (default: bundled SmolLM2-135M-Instruct)")
SERVED_MODEL_NAME = Option("--served-model-name", "model id reported by /v1/models and accepted in requests")
DTYPE = Option("--dtype", "weight and KV dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
DEVICE = Option("--device", "device the engine runs on", default="auto", choices=("auto", "cpu", "cuda"))
BLOCK_SIZE = Option("--block-size", "tokens per KV block (a power of two)", type=V.integer(1, 1024), default=16)
NUM_KV_BLOCKS = Option("--num-kv-blocks", "KV blocks to allocate (overrides --kv-cache-memory)", type=V.integer(1))
KV_CACHE_MEMORY = Option("--kv-cache-memory", "bytes of memory for the KV cache (suffixes K, M, G allowed)",
                         type=V.byte_size, default="4G")
ATTENTION_BACKEND = Option("--attention-backend", "paged-attention kernels: triton (CUDA), cpu (C++ kernels) or "
                           "reference (PyTorch); auto: triton on CUDA, cpu on the CPU", default="auto",
                           choices=("auto", "triton", "cpu", "reference"))
ENFORCE_EAGER = Option("--enforce-eager", "run decode steps eagerly instead of replaying CUDA graphs",
                       type=V.boolean, default=False, is_switch=True)
LOAD_FORMAT = Option("--load-format", "safetensors: the model's weights; random: random weights in the shapes "
                     "of the model directory's config.json (benchmarks without a download)", default="safetensors",
                     choices=("safetensors", "random"))
TENSOR_PARALLEL_SIZE = Option("--tensor-parallel-size", "ranks (GPUs) one model replica is split across; rank 0 "
                              "serves the step protocol and starts the others on this machine", type=V.integer(1),
                              default=1)
TP_LOCAL_RANKS = Option("--tp-local-ranks", "ranks of the group on each machine (default: all of them on this "
                        "one; GPUs per node when the group spans machines)", type=V.integer(1))
TP_RENDEZVOUS = Option("--tp-rendezvous", "where a group spanning machines meets: tcp://<rank 0's host>:<port> "
                       "(rank 0 listens on the port); default: a private file on this machine", type=V.rendezvous)
TP_TIMEOUT = Option("--tp-timeout", "seconds a rank waits in a collective, or for rank 0's next message, "
                    "before the group counts as broken and goes down", type=V.number(0, above=True), default=60.0)
TP_NODE_RANK = Option("--tp-node-rank", "which machine of the group this is: its ranks are node_rank * "
                      "tp_local_ranks onwards (0 is rank 0's machine)", type=V.integer(0), default=0)
TP_LOCAL_RANK = Option("--tp-local-rank", "this process's index on its machine (0 starts the machine's other "
                       "ranks; set by that process for them)", type=V.integer(0), default=0)
MAX_MODEL_LEN = Option("--max-model-len", "longest prompt + output in tokens (default: model's limit)",
                       type=V.integer(1))
MAX_NUM_SEQS = Option("--max-num-seqs", "cap on requests running in one step", type=V.integer(1), default=256)
MAX_NUM_BATCHED_TOKENS = Option("--max-num-batched-tokens", "token budget of one step", type=V.integer(1),
                                default=2048)
ENABLE_PREFIX_CACHING = Option("--enable-prefix-caching", "reuse KV blocks of shared prefixes", type=V.boolean,
                               default=True, is_switch=True)
REDIS_URL = Option("--redis-url", "Redis URL for the replica registry and prefix index (redis://[:pw@]host:port/db)",
                   type=V.redis_url, secret=True)
REPLICA_ID = Option("--replica-id", "stable name of this replica in the registry (default: hostname:port)")
ADVERTISE_URL = Option("--advertise-url", "URL routers use to reach this scheduler (default: http://<host>:<port>)",
                       type=V.HTTP_URL)
HEARTBEAT_INTERVAL = Option("--heartbeat-interval", "seconds between registry heartbeats", type=V.number(0, above=True),
                            default=1.0)
ENGINE_URL = Option("--engine", "engine step endpoint, e.g. tcp://127.0.0.1:7000", type=V.ENGINE_ADDRESS,
                    default="tcp://127.0.0.1:7000")
POLICY = Option("--policy", "routing policy", default="prefix",
                choices=("prefix", "least-loaded", "round-robin", "session"))
API_KEYS_FILE = Option("--api-keys-file", "file with one accepted API key per line")
API_KEYS = Option("--api-keys", "comma-separated accepted API keys (prefer the env var or a file)", secret=True)
DISCOVERY = Option("--discovery", "how routers find replicas", default="redis", choices=("redis", "kubernetes"))
K8S_SERVICE = Option("--k8s-service", "headless Service of the schedulers (for --discovery kubernetes)")
K8S_NAMESPACE = Option("--k8s-namespace", "namespace of that Service (default: the pod's own)")
MAX_QUEUE = Option("--max-queue", "requests that may wait for a free replica before 429", type=V.integer(0),
                   default=256)
MAX_BODY_BYTES = Option("--max-body-bytes", "largest accepted request body", type=V.integer(1), default=4 * 1024 * 1024)
REQUEST_TIMEOUT = Option("--request-timeout", "seconds before an upstream request is abandoned",
                         type=V.number(0, above=True), default=600.0)
DRAIN_TIMEOUT = Option("--drain-timeout", "seconds to finish in-flight requests after SIGTERM before exiting",
                       type=V.number(0), default=30.0)
COLD_START_TIMEOUT = Option("--cold-start-timeout",
                            "seconds a request is held while no replica is ready (scale from zero) before a 503; "
                            "0: answer 503 at once", type=V.number(0), default=0.0)
ENGINE_TIMEOUT = Option("--engine-timeout", "seconds one engine step may take before the engine counts as hung",
                        type=V.number(0, above=True), default=120.0)
INTERNAL_TOKEN_FILE = Option("--internal-token-file", "file holding the token routers and schedulers share: "
                             "routers present it, schedulers require it, registry records are signed with it")
INTERNAL_TOKEN = Option("--internal-token", "the internal token itself (prefer the file or the env var)",
                        secret=True)
CACHE_ISOLATION = Option("--cache-isolation", "prefix-cache sharing between API keys: shared (one tenant) or "
                         "per-key (a key never hits, or can time, another key's cached blocks)", default="shared",
                         choices=("shared", "per-key"))
IN_PROCESS_ENGINE = Option("--in-process-engine", "serve: run the engine in this process instead of a child "
                           "process of its own (slower: forward passes then share the GIL with HTTP)",
                           type=V.boolean, default=False, is_switch=True)
MAX_WAITING = Option("--max-waiting", "sequences a replica queues beyond its running batch before it answers "
                     "503 + Retry-After (default: twice --max-num-seqs, more for a large KV cache)", type=V.integer(0))
# None: inferred from the LoRA flags (services.commands.flag_rules), as `--lora-modules` alone turns LoRA on.
MAX_LORAS = Option("--max-loras", "LoRA adapters resident at once (slots; 0: no adapters; default: one per "
                   "--lora-modules adapter up to 8, 1 with only --lora-dir, else 0)", type=V.integer(0))
MAX_LORA_RANK = Option("--max-lora-rank", "highest LoRA rank served, every slot padded to it (default: 16, or the "
                       "highest rank among the --lora-modules adapters when that is higher)", type=V.integer(1, 512))
QUANTIZATION = Option("--quantization", "what the checkpoint's weights are (vLLM's spelling; default: what its "
                      "quantization_config says); gguf: serve a GGUF file's weights as they are, packed, instead of "
                      "converting them to a float checkpoint", choices=("gguf", "fp8", "gptq", "awq",
                                                                        "compressed-tensors"))
KV_CACHE_DTYPE = Option("--kv-cache-dtype", "KV cache element type: auto (the model's dtype) or fp8 (e4m3, per-tensor "
                        "scales from the checkpoint where it has them, else 1.0)", default="auto",
                        choices=("auto", "fp8", "fp8_e4m3"))
MAX_CPU_LORAS = Option("--max-cpu-loras", "loaded LoRA adapters kept in host memory (LRU; default: "
                       "max(--max-loras, 8))", type=V.integer(1))
LORA_MODULES = Option("--lora-modules", "LoRA adapters to load at start, NAME=PATH each (vLLM's spelling); "
                      "turns LoRA on", type=V.lora_module, nargs="+")
LORA_DIR = Option("--lora-dir", "the directory run-time loads (/v1/load_lora_adapter) may read adapters from")
LORA_ADMIN_KEY = Option("--lora-admin-key", "the key of /v1/load_lora_adapter and /v1/unload_lora_adapter "
                        "(distinct from API keys; prefer the env var); unset: run-time loading is off",
                        secret=True)
SPECULATIVE_CONFIG = Option("--speculative-config", "speculative decoding as vLLM's JSON object, e.g. "
                            "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}'; "
                            "methods ngram, draft_model and eagle3 (with \"model\": PATH); give the scheduler and "
                            "its engine the same value", type=speculative_json)
LOG_LEVEL = Option("--log-level", "logging level", default="info",
                   choices=("debug", "info", "warning", "error"))

# The engine's MAX_NUM_SEQS sizes its largest decode CUDA graph (give it the scheduler's value).
_ENGINE_CORE = (MODEL, DTYPE, DEVICE, BLOCK_SIZE, NUM_KV_BLOCKS, KV_CACHE_MEMORY, MAX_MODEL_LEN, ATTENTION_BACKEND,
                ENFORCE_EAGER, MAX_NUM_SEQS, LOAD_FORMAT, TENSOR_PARALLEL_SIZE, TP_LOCAL_RANKS, TP_RENDEZVOUS,
                TP_TIMEOUT, MAX_LORAS, MAX_LORA_RANK, MAX_CPU_LORAS, SPECULATIVE_CONFIG,
                QUANTIZATION, KV_CACHE_DTYPE)
_LORA_SERVING = (LORA_MODULES, LORA_DIR, LORA_ADMIN_KEY)
ENGINE_OPTIONS = (ENGINE_HOST, *_ENGINE_CORE, INTERNAL_TOKEN_FILE, INTERNAL_TOKEN, LOG_LEVEL)
# A tensor-parallel rank other than 0: no port, no token (it talks only to its group).
ENGINE_WORKER_OPTIONS = (*_ENGINE_CORE, TP_NODE_RANK, TP_LOCAL_RANK, LOG_LEVEL)
_SCHEDULING = (MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS, ENABLE_PREFIX_CACHING, MAX_MODEL_LEN, MAX_WAITING,
               SPECULATIVE_CONFIG)
SCHEDULER_OPTIONS = (HOST, MODEL, SERVED_MODEL_NAME, ENGINE_URL, *_SCHEDULING, REDIS_URL, REPLICA_ID,
                     ADVERTISE_URL, HEARTBEAT_INTERVAL, MAX_BODY_BYTES, DRAIN_TIMEOUT, ENGINE_TIMEOUT,
                     INTERNAL_TOKEN_FILE, INTERNAL_TOKEN, *_LORA_SERVING, LOG_LEVEL)
ROUTER_OPTIONS = (HOST, MODEL, REDIS_URL, POLICY, API_KEYS_FILE, API_KEYS, CACHE_ISOLATION, INTERNAL_TOKEN_FILE,
                  INTERNAL_TOKEN, DISCOVERY, K8S_SERVICE, K8S_NAMESPACE, MAX_QUEUE, COLD_START_TIMEOUT,
                  MAX_BODY_BYTES, REQUEST_TIMEOUT, DRAIN_TIMEOUT, LOG_LEVEL)
SERVE_OPTIONS = (HOST, MODEL, SERVED_MODEL_NAME, DTYPE, DEVICE, BLOCK_SIZE, NUM_KV_BLOCKS, KV_CACHE_MEMORY,
                 ATTENTION_BACKEND, ENFORCE_EAGER, TENSOR_PARALLEL_SIZE, TP_TIMEOUT, *_SCHEDULING, API_KEYS_FILE,
                 API_KEYS, CACHE_ISOLATION, MAX_BODY_BYTES, IN_PROCESS_ENGINE, MAX_LORAS, MAX_LORA_RANK,
                 MAX_CPU_LORAS, QUANTIZATION, KV_CACHE_DTYPE, *_LORA_SERVING, LOG_LEVEL)

# Default ports, shared by the CLI, `pagedserve up` and the chart.
DEFAULT_PORTS = {"router": 8000, "scheduler": 8100, "engine": 7000, "serve": 8000}


PORT_ENV = "PAGEDSERVE_PORT"


@dataclass(frozen=True)
class BadEnvValue:
    """An env var whose text its option refuses: the option's default until a flag overrides it, and a
    one-line error at parse time if none does (services.commands.flag_rules)."""

    env: str
    flag: str
    text: str
    reason: str

    def __str__(self) -> str:
        return f"{self.env}={self.text!r} (the env var of {self.flag}): {self.reason}"


def env_default(opt: Option, env: str | None = None) -> Any:
    """The option's default: its env var's value, parsed as the flag's text would be, when set."""
    env = env or opt.env
    if env not in os.environ:
        return opt.default
    text = os.environ[env]
    try:
        values = [opt.type(v) for v in text.split()] if opt.nargs else [opt.type(text)]
        for v in values:
            if opt.choices is not None and v not in opt.choices:
                raise ValueError(f"must be one of {', '.join(opt.choices)}")
    except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
        reason = str(exc) or f"not a valid {getattr(opt.type, '__name__', 'value')}"
        if opt.secret:  # the value's own type redacts what it echoes (a Redis password); the raw text never
            text = "(hidden)"
        return BadEnvValue(env, opt.flag, text, reason)
    return values if opt.nargs else values[0]


def add_options(parser: argparse.ArgumentParser, options: tuple[Option, ...], port: int | None) -> None:
    """Add `options` (and --port, unless None) to `parser`; each default comes from its env var when set."""
    seen: set[str] = set()
    if port is not None:
        port_opt = Option("--port", "port to listen on", type=V.PORT, default=port)
        parser.add_argument("--port", type=V.PORT, default=env_default(port_opt, PORT_ENV),
                            help=f"port to listen on (env {PORT_ENV})")
    for opt in options:
        if opt.dest in seen:
            continue
        seen.add(opt.dest)
        default = env_default(opt)
        help_text = f"{opt.help} (env {opt.env})"
        if opt.is_switch:
            parser.add_argument(opt.flag, dest=opt.dest, action=argparse.BooleanOptionalAction, default=default,
                                help=help_text)
        else:
            parser.add_argument(opt.flag, dest=opt.dest, type=opt.type, default=default, choices=opt.choices,
                                nargs=opt.nargs, help=help_text)


# Env vars read outside this table: the cache root (services.model_files.model_source, kernels.cpu.build) and the
# CPU kernels' switches and build wait (kernels.cpu).
OTHER_ENV_VARS = frozenset({PORT_ENV, "PAGEDSERVE_CACHE_DIR", "PAGEDSERVE_CPU_KERNELS", "PAGEDSERVE_CPU_AMX",
                            "PAGEDSERVE_KERNEL_BUILD_TIMEOUT"})


def all_env_vars() -> set[str]:
    """Every env var any service reads (the chart's tests check against this)."""
    names = set(OTHER_ENV_VARS)
    for group in (ENGINE_OPTIONS, ENGINE_WORKER_OPTIONS, SCHEDULER_OPTIONS, ROUTER_OPTIONS, SERVE_OPTIONS):
        names.update(opt.env for opt in group)
    return names
