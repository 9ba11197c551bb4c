"""What a subcommand's flags imply, and which combinations cannot work: checked while the command line is
parsed, before any model loads or process starts.

Each value is checked alone by its type (services.commands.flag_values); the rules here see the whole
command line. A flag that implies another is filled in, as SGLang does for its `--lora-paths` (adapters
given: LoRA on, a slot for each adapter up to `INFERRED_MAX_LORAS`, padded to the highest adapter rank;
vLLM instead stops at start without `--enable-lora`, or with an adapter over `--max-lora-rank`); a
combination that cannot work raises `FlagError`, which the parser prints as one line naming the flags,
with exit code 2. Rules come in two kinds: `RULES` read only the command line (the Helm chart's tests
parse rendered pods' arguments with them), `START_RULES` also what the command starts with beyond it (the
files the flags name: model, adapters, keys, token; secrets its env vars carry), and run when the launcher
starts a command for real (`build_parser(starting=True)`).
"""

from __future__ import annotations

import argparse
import importlib
import ipaddress
import socket
from collections.abc import Callable
from urllib.parse import urlparse

from services.commands.flag_values import FlagError, flag
from services.commands.settings import BadEnvValue

# Slots `--lora-modules` alone turns on: one per adapter up to this (SGLang's default of adapters per batch);
# beyond it adapters take turns in the slots, as they do whenever there are more adapters than slots.
INFERRED_MAX_LORAS = 8
DEFAULT_MAX_LORA_RANK = 16  # vLLM's default too


Rule = Callable[[argparse.Namespace], None]


def _named(ns: argparse.Namespace, dest: str, message: str) -> str:
    """`--flag VALUE: message` for a setting refused by the part that owns it (its field is the flag's dest)."""
    value = getattr(ns, dest, None)
    return f"{flag(dest)}{'' if value is None else f' {value}'}: {message}"


def note(ns: argparse.Namespace, text: str) -> None:
    """An implied value, logged once logging is set up (services.commands.cli.main)."""
    ns.implied = [*getattr(ns, "implied", []), text]


# -- rules on the command line alone --------------------------------------------------------------------

def env_values(ns: argparse.Namespace) -> None:
    """An env var its flag refuses, and no flag given instead of it (a flag wins over its env var)."""
    for value in vars(ns).values():
        if isinstance(value, BadEnvValue):
            raise FlagError(str(value))


def engine_config(ns: argparse.Namespace) -> None:
    """What EngineConfig refuses (block size, tensor-parallel split), named by its flag."""
    from services.engine.config import EngineConfig, EngineConfigError

    fields = {**vars(ns), "model": None} if isinstance(ns.model, list) else vars(ns)  # `up`: several models
    try:
        config = EngineConfig.from_args(argparse.Namespace(**fields))
    except EngineConfigError as exc:
        raise FlagError(_named(ns, exc.field, exc.message)) from None
    if not hasattr(ns, "lora_modules"):  # an engine alone: its LoRA slots are what its flags say, or none
        ns.max_loras, ns.max_lora_rank = config.max_loras, config.max_lora_rank
    if ns.command == "engine" and config.ranks_per_machine < config.tensor_parallel_size and not config.tp_rendezvous:
        raise FlagError(f"--tp-local-ranks {ns.tp_local_ranks} < --tensor-parallel-size {ns.tensor_parallel_size} "
                        "spans machines: give --tp-rendezvous tcp://<this machine's address>:<port>")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def engine_listener(ns: argparse.Namespace) -> None:
    if not is_loopback(ns.host) and not (ns.internal_token_file or ns.internal_token):
        raise FlagError(f"--host {ns.host} would let anyone who reaches the port run steps and reset the KV cache: "
                        "give --internal-token-file (or listen on 127.0.0.1)")


def lora_modules(ns: argparse.Namespace) -> None:
    """Adapter names: unique, none the base model's; the admin key only with somewhere to load from."""
    names = [m.partition("=")[0] for m in ns.lora_modules or []]
    for name in names:
        if names.count(name) > 1:
            raise FlagError(f"--lora-modules: the adapter name {name!r} is given twice")
        if name == getattr(ns, "served_model_name", None):
            raise FlagError(f"--lora-modules: {name!r} is the base model's --served-model-name")
    if ns.lora_admin_key and not ns.lora_dir and not names:
        raise FlagError("--lora-admin-key loads adapters at run time from --lora-dir only: give --lora-dir too")


def lora_slots(ns: argparse.Namespace) -> None:
    """Adapters given turn LoRA on with enough slots; --max-loras 0 beside them cannot work."""
    adapters = len(ns.lora_modules or [])
    asks = "--lora-modules" if adapters else "--lora-dir" if ns.lora_dir else None
    if ns.max_loras is None:
        ns.max_loras = min(adapters, INFERRED_MAX_LORAS) if adapters else 1 if ns.lora_dir else 0
        if asks:
            note(ns, f"{asks} turns LoRA on: --max-loras {ns.max_loras}")
    elif ns.max_loras == 0 and asks:
        raise FlagError(f"--max-loras 0 serves no adapters, but {asks} gives some: leave --max-loras out (one slot "
                        "per adapter) or give it 1 or more")


def several_models(ns: argparse.Namespace) -> None:
    from services.commands.model_specs import parse_model_specs

    try:
        specs = parse_model_specs(ns.model, ns.replicas, ns.served_model_name)
    except ValueError as exc:
        raise FlagError(str(exc)) from None
    if len(specs) > 1 and ns.lora_modules:
        raise FlagError("--lora-modules serves adapters of one model; with several --model, load adapters per "
                        "replica (its admin endpoint) or let replicas load them from --lora-dir")


def up_cluster(ns: argparse.Namespace) -> None:
    if ns.redis_url and ns.redis_cluster:
        raise FlagError("--redis-url uses an existing Redis, --redis-cluster starts one: give one of them")
    if ns.port + ns.routers - 1 > 65535:
        raise FlagError(f"--routers {ns.routers} from --port {ns.port} runs past port 65535")


def router_discovery(ns: argparse.Namespace) -> None:
    if ns.discovery == "kubernetes" and not ns.k8s_service:
        raise FlagError("--discovery kubernetes needs --k8s-service (the schedulers' headless Service)")


def api_keys(ns: argparse.Namespace) -> None:
    if ns.api_keys is not None and not [k for k in ns.api_keys.split(",") if k.strip()]:
        raise FlagError("--api-keys (PAGEDSERVE_API_KEYS) is set but holds no key: unset it to serve without keys")


def sampling(ns: argparse.Namespace) -> None:
    from services.request.errors import InvalidRequestError
    from services.request.sampling_params import SamplingParams

    try:
        SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k,
                       seed=ns.seed)
    except InvalidRequestError as exc:
        raise FlagError(_named(ns, exc.field, exc.message)) from None


def listening_address(ns: argparse.Namespace) -> None:
    """wait-for-disconnect matches the engine's local address in /proc/net/tcp: an IP address."""
    host = urlparse(ns.engine).hostname
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise FlagError(f"--engine {ns.engine}: give the engine's listening IP address (tcp://IP:PORT), "
                        f"not the name {host!r}") from None


# -- rules on what a command starts with beyond its command line: files, secrets in its environment -----

def worker_rank(ns: argparse.Namespace) -> None:
    """engine-worker is a rank other than 0 (in a pod its node rank is an env var from the LeaderWorkerSet)."""
    from services.engine.config import EngineConfig, EngineConfigError

    try:
        EngineConfig.from_args(ns).worker_rank(ns.tp_node_rank, ns.tp_local_rank)
    except EngineConfigError as exc:
        raise FlagError(_named(ns, exc.field, exc.message)) from None


def listen_address(ns: argparse.Namespace) -> None:
    """The address a server will listen on can be bound now: a port taken, or a host this machine does not
    have, is found before minutes of model loading rather than after."""
    ports = range(ns.port, ns.port + ns.routers) if ns.command == "up" else [ns.port]
    for port in ports:
        try:
            family, kind, proto, _, address = socket.getaddrinfo(ns.host, port, type=socket.SOCK_STREAM,
                                                                 flags=socket.AI_PASSIVE)[0]
        except (socket.gaierror, UnicodeError) as exc:
            raise FlagError(f"--host {ns.host}: not an address of this machine ({exc})") from None
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do: TIME_WAIT is no conflict
            try:
                s.bind(address)
            except OSError as exc:
                raise FlagError(f"--port {port}: cannot listen on {ns.host}:{port}: {exc.strerror}") from None


def router_registry(ns: argparse.Namespace) -> None:
    if not ns.redis_url:  # in a pod, a Secret's env var
        raise FlagError("--redis-url (or PAGEDSERVE_REDIS_URL) is required: the registry of replicas lives there")


def model_files(ns: argparse.Namespace) -> None:
    """The model exists: a Hugging Face directory or a .gguf file (or the bundled model, installed)."""
    from services.model_files.model_source import gguf_of

    if ns.command == "router" and ns.model is None:
        return  # the router reads each model's tokenizer from the registry
    models = [ns.model]
    if isinstance(ns.model, list):  # `up`: PATH, NAME=PATH or NAME=PATH:REPLICAS
        from services.commands.model_specs import parse_model_specs

        models = [s.path for s in parse_model_specs(ns.model, ns.replicas, ns.served_model_name)]
    for model in models:
        try:
            gguf = gguf_of(model)
        except OSError as exc:
            raise FlagError(f"--model {model or '(default)'}: {exc}") from None
        if ns.command == "convert" and gguf is None:
            raise FlagError(f"--model {model}: already a Hugging Face directory (config.json): serve it as it is, "
                            "there is nothing to convert")


def lora_files(ns: argparse.Namespace) -> None:
    """Every adapter readable; --max-lora-rank at least their highest rank (filled in when not given)."""
    from services.engine.config import MAX_LORA_RANK
    from services.model_files.lora_files import adapter_rank

    ranks = {}
    for module in ns.lora_modules or []:
        try:
            ranks[module] = adapter_rank(module.partition("=")[2])
        except (ValueError, OSError) as exc:
            raise FlagError(f"--lora-modules {module}: {exc}") from None
    if ns.lora_dir is not None:
        from pathlib import Path

        if not Path(ns.lora_dir).is_dir():
            raise FlagError(f"--lora-dir {ns.lora_dir}: not a directory")
    if not ranks or not hasattr(ns, "max_lora_rank"):
        return  # the scheduler: its engine's --max-lora-rank refuses a higher rank when it loads the adapter
    module, highest = max(ranks.items(), key=lambda kv: kv[1])
    if highest > MAX_LORA_RANK:
        raise FlagError(f"--lora-modules {module}: rank {highest} is over the highest rank served, {MAX_LORA_RANK}")
    if ns.max_lora_rank is None:
        ns.max_lora_rank = max(DEFAULT_MAX_LORA_RANK, highest)
        if highest > DEFAULT_MAX_LORA_RANK:
            note(ns, f"--lora-modules {module} has rank {highest}: --max-lora-rank {highest}")
    elif highest > ns.max_lora_rank:
        raise FlagError(f"--lora-modules {module} has rank {highest}, over --max-lora-rank {ns.max_lora_rank}: raise "
                        f"it to {highest} or leave it out")


def secrets(ns: argparse.Namespace) -> None:
    """The internal token and the API keys configured are readable and hold something."""
    from services.contracts.internal_auth import InternalToken

    try:
        InternalToken.from_sources(getattr(ns, "internal_token_file", None), None)
    except (ValueError, OSError) as exc:
        raise FlagError(f"--internal-token-file {ns.internal_token_file}: {exc}") from None
    if not hasattr(ns, "api_keys_file"):
        return
    from services.router.auth import ApiKeys

    try:
        keys = ApiKeys.from_sources(ns.api_keys_file, ns.api_keys)
    except (ValueError, OSError) as exc:
        raise FlagError(f"--api-keys-file {ns.api_keys_file}: {exc}" if ns.api_keys_file else str(exc)) from None
    admin = getattr(ns, "lora_admin_key", None)
    if admin and keys.enabled:
        from services.openai_api.errors import APIError

        try:
            keys.check(f"Bearer {admin}")
        except APIError:
            return  # not an API key: as it must be
        raise FlagError("--lora-admin-key must differ from every API key (a client key must not load adapters)")


def output_dir(ns: argparse.Namespace) -> None:
    """convert writes a sibling of --output and renames it: the directory above must be writable."""
    import os
    from pathlib import Path

    out = Path(ns.output).expanduser().absolute()
    if out.exists() and not out.is_dir():
        raise FlagError(f"--output {ns.output}: a file is there, not a directory")
    above = next(p for p in out.parents if p.exists())
    if not above.is_dir() or not os.access(above, os.W_OK | os.X_OK):
        raise FlagError(f"--output {ns.output}: {above} cannot be written here")


# -- which rules each subcommand runs --------------------------------------------------------------------

RULES: dict[str, tuple[Rule, ...]] = {
    "serve": (lora_modules, lora_slots, engine_config, api_keys),
    "up": (several_models, lora_modules, lora_slots, engine_config, up_cluster, api_keys),
    "engine": (engine_config,),
    "engine-worker": (engine_config,),
    "scheduler": (lora_modules,),
    "router": (router_discovery, api_keys),
    "generate": (sampling,),
    "wait-for-disconnect": (listening_address,),
}
START_RULES: dict[str, tuple[Rule, ...]] = {
    "serve": (model_files, lora_files, secrets, listen_address),
    "up": (model_files, lora_files, secrets, listen_address),
    "engine": (engine_listener, model_files, secrets, listen_address),
    "engine-worker": (worker_rank, model_files),
    "scheduler": (model_files, lora_files, secrets, listen_address),
    "router": (router_registry, model_files, secrets, listen_address),
    "generate": (model_files,),
    "convert": (model_files, output_dir),
    "probe engine": (secrets,),
}


def check(command: str, ns: argparse.Namespace, starting: bool) -> None:
    """Run `command`'s rules on its parsed flags (and, `starting`, on what it starts with), filling in
    implied values; raises FlagError."""
    env_values(ns)
    ns.command = command.split()[0]
    for rule in (*RULES.get(command, ()), *(START_RULES.get(command, ()) if starting else ())):
        rule(ns)
    if getattr(ns, "flag_check", None):  # a bench's own check, named as its handler is
        module, _, function = ns.flag_check.partition(":")
        getattr(importlib.import_module(module), function)(ns)
