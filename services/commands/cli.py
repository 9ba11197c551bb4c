"""The `pagedserve` command: one subcommand per service plus generate and bench.

Parsers are built from `services.commands.settings` (the one source of truth for flags and env vars); each
subcommand's implementation is imported only when it runs, so `pagedserve router` never loads torch.
A command line that cannot work is refused while it is parsed (values by their types in
`services.commands.flag_values`, combinations and implied flags by `services.commands.flag_rules`): one line
naming the flag, exit code 2, before any model loads or process starts.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import logging
import sys

from services.commands import flag_values as V
from services.commands import settings as S
from services.commands.bench_flags import add_bench
from services.commands.flag_rules import FlagError, check


class CommandParser(argparse.ArgumentParser):
    """argparse, with each subcommand's rules (services.commands.flag_rules, by its name: "serve", "probe
    engine") run on what it parsed, and every refusal one line: `pagedserve serve: error: <what is wrong>`."""

    def __init__(self, *args, starting: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.starting = starting

    def add_subparsers(self, **kwargs):
        kwargs.setdefault("parser_class", functools.partial(CommandParser, starting=self.starting))
        return super().add_subparsers(**kwargs)

    def parse_known_args(self, args=None, namespace=None):
        ns, extras = super().parse_known_args(args, namespace)
        command = self.prog.partition(" ")[2]
        if command and self._subparsers is None and not extras:  # a subcommand itself, all of it understood
            try:
                check(command, ns, self.starting)
            except FlagError as exc:
                self.error(str(exc))
        return ns, extras

    def error(self, message: str):
        # A value's line breaks and control characters, escaped: the error stays one printable line.
        message = "".join(c if c.isprintable() else repr(c)[1:-1] for c in message)
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} -h)\n")


# subcommand -> (handler "module:function", options, default port or None, help)
_SERVICES = {
    "serve": ("services.commands.serve:run", S.SERVE_OPTIONS, S.DEFAULT_PORTS["serve"],
              "router + scheduler + engine in one process (no Redis needed)"),
    "engine": ("services.commands.engine:run", S.ENGINE_OPTIONS, S.DEFAULT_PORTS["engine"],
               "the engine service: model weights + KV cache, step protocol over TCP"),
    "scheduler": ("services.commands.scheduler:run", S.SCHEDULER_OPTIONS, S.DEFAULT_PORTS["scheduler"],
                  "the scheduler service: continuous batching + OpenAI API for one engine"),
    "router": ("services.commands.router:run", S.ROUTER_OPTIONS, S.DEFAULT_PORTS["router"],
               "the router: public OpenAI endpoint, prefix-aware routing over Redis"),
}


def _add_engine_worker(sub) -> None:
    p = sub.add_parser("engine-worker", help="one tensor-parallel rank other than 0 (started by the engine, or "
                       "on another machine of a group that spans machines)")
    S.add_options(p, S.ENGINE_WORKER_OPTIONS, None)
    p.set_defaults(handler="services.commands.engine_worker:run")


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text offline from a prompt")
    p.add_argument("prompt", nargs="+", help="prompt text (several prompts are batched together)")
    p.add_argument("--model", default=None, help="Hugging Face directory or .gguf file (default: SmolLM2)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--max-tokens", type=V.integer(1), default=64)
    p.add_argument("--temperature", type=V.number(0), default=0.0)
    p.add_argument("--top-p", type=V.number(0, above=True, high=1), default=1.0)
    p.add_argument("--top-k", type=V.integer(-1), default=-1)
    p.add_argument("--seed", type=V.integer(), default=None)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.set_defaults(handler="services.commands.generate:run")


def _add_up(sub) -> None:
    p = sub.add_parser("up", help="local cluster: redis-server, N scheduler+engine replicas and a router")
    # Engines are processes in `up`; --model is its own (repeatable) flag here.
    own = tuple(o for o in S.SERVE_OPTIONS if o not in (S.IN_PROCESS_ENGINE, S.MODEL))
    S.add_options(p, own + (S.REDIS_URL, S.POLICY, S.MAX_QUEUE), S.DEFAULT_PORTS["router"])
    p.add_argument("--model", action="append", default=None,
                   help="a model to serve: PATH (Hugging Face directory or .gguf; default: the bundled SmolLM2), "
                   "or, repeated, NAME=PATH or NAME=PATH:REPLICAS for several models behind the routers "
                   f"(env {S.MODEL.env}: one PATH, which the replicas read themselves)")
    p.add_argument("--replicas", type=V.integer(1), default=2, help="scheduler+engine replicas to start (per model)")
    p.add_argument("--routers", type=V.integer(1), default=1,
                   help="router processes to start (ports port, port+1, ...)")
    p.add_argument("--redis-cluster", type=V.integer(0), default=0, metavar="N",
                   help="start a local Redis Cluster of N shards (+1 replica each) instead of one redis-server")
    p.set_defaults(handler="services.commands.up:run")


def _add_pod_tools(sub) -> None:
    """Commands the Helm chart runs beside the services: model conversion, probes, preStop hooks."""
    c = sub.add_parser("convert", help="convert a GGUF model once into a safetensors directory (or its tokenizer)")
    c.add_argument("--model", default=None, help="a .gguf file or a directory holding one (default: bundled SmolLM2)")
    c.add_argument("--output", required=True, help="directory to write (a converted one is kept as it is)")
    c.add_argument("--tokenizer-only", action="store_true",
                   help="tokenizer, chat template and config only: what the router and scheduler read")
    c.add_argument("--log-level", default="info", choices=S.LOG_LEVEL.choices)
    c.set_defaults(handler="services.commands.convert:run")
    p = sub.add_parser("probe", help="health probes for Kubernetes exec probes (exit 0: healthy)")
    psub = p.add_subparsers(dest="probe_target", required=True)
    e = psub.add_parser("engine", help="a `health` round trip on the engine's step protocol")
    e.add_argument("--engine", type=V.ENGINE_ADDRESS, default=S.ENGINE_URL.default, help="engine step endpoint")
    e.add_argument("--timeout", type=V.number(0, above=True), default=3.0, help="seconds to wait for the answer")
    e.add_argument("--internal-token-file", default=None,
                   help="the engine's internal token (only an engine bound beyond loopback requires one)")
    e.set_defaults(handler="services.commands.probe:run")
    w = sub.add_parser("wait-for-disconnect", help="preStop hook: wait until no client is connected to the engine")
    w.add_argument("--engine", type=V.ENGINE_ADDRESS, default=S.ENGINE_URL.default,
                   help="the engine's listening address")
    w.add_argument("--timeout", type=V.number(0), required=True, help="seconds to wait at most")
    w.add_argument("--interval", type=V.number(0, above=True), default=1.0, help="seconds between checks")
    w.set_defaults(handler="services.commands.prestop:run")


def build_parser(starting: bool = False) -> CommandParser:
    """The `pagedserve` parser. `starting`: the command is about to run here, so also check what it starts
    with beyond its command line (the files its flags name, secrets in its env vars) and fill in what they
    imply; the launcher does, a test of a rendered pod's arguments does not."""
    parser = CommandParser(prog="pagedserve", description=__doc__.splitlines()[0], starting=starting)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (handler, options, port, help_text) in _SERVICES.items():
        p = sub.add_parser(name, help=help_text)
        S.add_options(p, options, port)
        p.set_defaults(handler=handler)
    _add_engine_worker(sub)
    _add_up(sub)
    _add_pod_tools(sub)
    _add_generate(sub)
    add_bench(sub)
    return parser


def _pin_threads() -> None:
    # Keep each OpenMP worker on its own core: on small VMs migrating threads cost a few percent of
    # throughput (measured 2.5% on W1). Must happen before torch loads its OpenMP runtime; an
    # operator's own settings win.
    import os

    os.environ.setdefault("OMP_PROC_BIND", "close")
    os.environ.setdefault("OMP_PLACES", "cores")


def main(argv: list[str] | None = None) -> int:
    _pin_threads()
    try:
        args = build_parser(starting=True).parse_args(argv)
    except SystemExit as exc:  # -h (0), or a refused command line (2), already printed
        return 0 if exc.code is None else int(exc.code)
    logging.basicConfig(level=getattr(args, "log_level", "info").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for implied in getattr(args, "implied", []):
        logging.getLogger("pagedserve").info("%s", implied)
    # httpx logs every request at INFO: per-request noise (and cost) on the router's hot path.
    for noisy in ("httpx", "httpx2"):  # openai's client logs through "httpx2"
        logging.getLogger(noisy).setLevel(logging.WARNING)
    module_name, func_name = args.handler.split(":")
    handler = getattr(importlib.import_module(module_name), func_name)
    return int(handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
