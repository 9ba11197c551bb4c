"""Every subcommand's flags, walked as a new user would try them: the launcher answers with a parsed
command line or one error line naming the flag (exit code 2), never a traceback.

The walk is generated from the parser itself: every leaf subcommand (`serve`, `probe engine`, `bench
serve`, ...), every flag and positional it has, values drawn by hypothesis from each flag's own type and
choices plus hostile text (negative and huge numbers, malformed sizes and URLs, paths that are not there or
are the wrong kind of file), several flags at once, and the env vars of the flag table (services/commands/
settings.py). Each command line goes through `build_parser(starting=True)`, which is what `pagedserve`
runs before anything starts: value types, the rules on combinations, and the checks of the files the flags
name. A few real `pagedserve` processes show the exit code and stderr end to end.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.commands import settings as S
from services.commands.cli import build_parser
from services.commands.flag_rules import DEFAULT_MAX_LORA_RANK, INFERRED_MAX_LORAS
from services.commands.ports import free_port
from services.engine.config import EngineConfig

ENGINE_COMMANDS = {"serve", "up", "engine", "engine-worker"}
ERROR_LINE = re.compile(r"^pagedserve (?P<command>[a-z -]+?): error: (?P<message>.+)$")
# What an error line must name: a flag, an env var, or (argparse's own) a missing argument or a choice.
NAMES_WHAT = re.compile(r"--[a-z]|PAGEDSERVE_[A-Z_]+|arguments are required|invalid choice")


def leaf_commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
    """(name words, parser) of every subcommand that takes flags itself (`probe engine`, not `probe`)."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield prefix, parser
        return
    for name, sub in subs[0].choices.items():
        yield from leaf_commands(sub, (*prefix, name))


LEAVES = {" ".join(words): p for words, p in leaf_commands(build_parser())}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """The kinds of thing a flag may name: a model directory, a .gguf file, adapters of rank 8 and 32
    and broken ones, key and token files (full and empty), a plain file, an empty directory."""
    root = tmp_path_factory.mktemp("flag-files")
    model = root / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (root / "model.gguf").write_bytes(b"GGUF")
    out = {"model": model, "gguf": root / "model.gguf"}
    for rank in (8, 32):
        d = root / "adapters" / f"r{rank}"
        d.mkdir(parents=True)
        (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 16,
                                                           "target_modules": ["q_proj", "v_proj"]}))
        (d / "adapter_model.safetensors").write_bytes(b"")  # the engine reads the weights; the launcher, the rank
        out[f"r{rank}"] = d
    bad = root / "adapters" / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text("{not json")
    (bad / "adapter_model.safetensors").write_bytes(b"")
    pickled = root / "adapters" / "pickled"
    pickled.mkdir()
    (pickled / "adapter_model.bin").write_bytes(b"\x80")
    out.update(bad=bad, pickled=pickled, adapters=root / "adapters")
    for name, text in (("keys", "key-1\nkey-2\n"), ("no_keys", "\n"), ("token", "a-shared-token"), ("no_token", "")):
        (root / name).write_text(text)
        out[name] = root / name
    (root / "plain.txt").write_text("x")
    (root / "empty").mkdir()
    out.update(plain=root / "plain.txt", empty=root / "empty", missing=root / "missing")
    return out


def hostile_texts(f: dict[str, Path]) -> list[str]:
    paths = [str(f[k]) for k in ("model", "gguf", "r8", "bad", "plain", "empty", "missing", "token", "no_keys")]
    return ["", " ", "-1", "0", "1", "3", "7", "16", "65536", "99999999999999999999999", "1e309", "nan", "inf",
            "-inf", "0.5", "abc", "\u2603", "4X", "4G", "-1G", "1.5g", "infG", "a=b", "a=", "=b", "a b=c", "1,2,4",
            "0,x", "x,,y", "ttft=1s", "ttft=xms", "tcp://", "tcp://127.0.0.1:7000", "tcp://host", "tcp://h:0",
            "tcp://h:99999", "http://127.0.0.1:9", "redis://127.0.0.1:1/0", "ftp://x", "file:///tmp/r", *paths,
            f"a={f['r8']}", f"b={f['r32']}", f"c={f['bad']}", f"d={f['pickled']}", f"e={f['missing']}",
            f"m={f['model']}", f"m={f['model']}:1", f"n={f['missing']}:2"]


def good_texts(action: argparse.Action, f: dict[str, Path]) -> list[str]:
    """Values that should parse, by what the flag is."""
    by_flag = {"--model": [str(f["model"])], "--lora-modules": [f"a={f['r8']}", f"b={f['r32']}"],
               "--lora-dir": [str(f["adapters"])], "--api-keys-file": [str(f["keys"])],
               "--internal-token-file": [str(f["token"])], "--engine": ["tcp://127.0.0.1:7000"],
               "--redis-url": ["redis://127.0.0.1:6379/0"], "--tp-rendezvous": ["tcp://127.0.0.1:29500"],
               "--advertise-url": ["http://127.0.0.1:8100"], "--endpoint": ["http://127.0.0.1:9"],
               "--output": [str(f["empty"] / "out")], "--block-size": ["16", "32"], "--kv-cache-memory": ["64M"]}
    texts = list(by_flag.get(action.option_strings[0] if action.option_strings else "", []))
    if action.choices is not None:
        texts += [str(c) for c in action.choices]
    if action.default is not None and not isinstance(action.default, (bool, list)):
        texts.append(str(action.default))
    return texts or ["1"]


def flag_args(action: argparse.Action, f: dict[str, Path]) -> st.SearchStrategy[list[str]]:
    """One flag on the command line: its switch form, or the flag and one or more values."""
    name = action.option_strings[0]
    if isinstance(action, argparse.BooleanOptionalAction):
        return st.sampled_from([[name], ["--no-" + name[2:]]])
    if action.nargs == 0:  # store_true
        return st.just([name])
    value = st.one_of(st.sampled_from(good_texts(action, f)), st.sampled_from(hostile_texts(f)),
                      st.integers(-10, 70_000).map(str), st.text(max_size=8))
    count = st.integers(1, 3) if action.nargs in ("+", "*") else st.just(1)
    return count.flatmap(lambda n: st.lists(value, min_size=n, max_size=n)).map(
        lambda values: [f"{name}={values[0]}"] if len(values) == 1 and values[0].startswith("-") else [name, *values])


def positional_args(action: argparse.Action) -> st.SearchStrategy[list[str]]:
    if action.nargs == argparse.REMAINDER:  # before-after: `-- <bench throughput args>`
        return st.sampled_from([[], ["--", "--scale", "0.1"], ["--", "--scale", "-1"], ["--", "--bogus"]])
    return st.lists(st.sampled_from(["hello", "a=b", "", "\u2603"]), min_size=0, max_size=2)


def command_lines(command: str, f: dict[str, Path]) -> st.SearchStrategy[list[str]]:
    parser = LEAVES[command]
    flags = [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
    positionals = [a for a in parser._actions if not a.option_strings]
    chosen = st.lists(st.sampled_from(flags), max_size=6, unique_by=lambda a: a.dest) if flags else st.just([])
    return st.tuples(chosen.flatmap(lambda acts: st.tuples(*(flag_args(a, f) for a in acts))),
                     st.tuples(*(positional_args(a) for a in positionals))).map(
        lambda parts: [*command.split(), *(t for group in parts[0] for t in group),
                       *(t for group in parts[1] for t in group)])


def env_vars(command: str, f: dict[str, Path]) -> st.SearchStrategy[dict[str, str]]:
    """A few of the command's own env vars (from the flag table), set to good or hostile text."""
    dests = {a.dest for a in LEAVES[command]._actions}
    options = {o.env: o for group in (S.SERVE_OPTIONS, S.ENGINE_OPTIONS, S.ENGINE_WORKER_OPTIONS,
                                      S.SCHEDULER_OPTIONS, S.ROUTER_OPTIONS) for o in group if o.dest in dests}
    names = sorted(options) + ([S.PORT_ENV] if "port" in dests else [])
    if not names:
        return st.just({})
    texts = st.sampled_from(hostile_texts(f) + ["true", "off", "maybe", "64M", str(f["model"]), "redis://r:1/0"])
    return st.dictionaries(st.sampled_from(names), texts, max_size=3)


@contextlib.contextmanager
def environment(env: dict[str, str]):
    saved = {k: v for k, v in os.environ.items() if k.startswith("PAGEDSERVE_")}
    for k in saved:
        del os.environ[k]
    os.environ.update(env)
    try:
        yield
    finally:
        for k in env:
            os.environ.pop(k, None)
        os.environ.update(saved)


def launch(argv: list[str], env: dict[str, str] | None = None, parser=None):
    """What `pagedserve` does with `argv` before anything starts: (exit code, stderr, parsed flags). An
    exception other than the parser's exit is the traceback this test exists to catch: it propagates."""
    err = io.StringIO()
    with environment(env or {}), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            return 0, err.getvalue(), (parser or build_parser(starting=True)).parse_args(argv)
        except SystemExit as exc:
            return exc.code, err.getvalue(), None


def check_answer(command: str, argv: list[str], code, stderr: str, ns, f: dict[str, Path],
                 env: dict[str, str] | None = None) -> None:
    assert "Traceback" not in stderr, stderr
    assert code in (0, 2), (argv, code, stderr)
    if code == 2:
        lines = stderr.strip().splitlines()
        assert len(lines) == 1, (argv, stderr)
        m = ERROR_LINE.match(lines[0])
        assert m and m["command"] == command, (argv, lines[0])
        assert NAMES_WHAT.search(m["message"]), (argv, lines[0])
        return
    # Parsed: no refused env var leaks through as a value, what the engine is built from builds, and
    # implied flags hold what they promise.
    assert not [v for v in vars(ns).values() if isinstance(v, S.BadEnvValue)], argv
    if command in ENGINE_COMMANDS:
        EngineConfig.from_args(argparse.Namespace(**{**vars(ns), "model": None}))
    if command in ("serve", "up"):
        ranks = {str(f["r8"]): 8, str(f["r32"]): 32}
        modules = ns.lora_modules or []
        if modules or ns.lora_dir:
            assert ns.max_loras >= 1, argv
        if modules and "--max-loras" not in " ".join(argv) and "PAGEDSERVE_MAX_LORAS" not in (env or {}):
            assert ns.max_loras == min(len(modules), INFERRED_MAX_LORAS), argv
        highest = max((ranks.get(m.partition("=")[2], 0) for m in modules), default=0)
        assert (ns.max_lora_rank or DEFAULT_MAX_LORA_RANK) >= highest, argv


@pytest.mark.parametrize("command", sorted(LEAVES))
def test_every_flag_of_every_subcommand_parses_or_is_one_error_line(command, files):
    parser = build_parser(starting=True)  # env-free here: one parser serves every example

    @settings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(argv=command_lines(command, files))
    def walk(argv):
        code, stderr, ns = launch(argv, parser=parser)
        check_answer(command, argv, code, stderr, ns, files)

    walk()


@pytest.mark.parametrize("command", sorted(LEAVES))
def test_every_subcommand_has_help(command):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([*command.split(), "-h"])
    assert exit_.value.code == 0 and out.getvalue().startswith(f"usage: pagedserve {command}")


@pytest.mark.parametrize("command", ["serve", "up", "engine", "engine-worker", "scheduler", "router"])
def test_env_vars_are_checked_as_their_flags_are(command, files):
    @settings(max_examples=15, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(argv=command_lines(command, files), env=env_vars(command, files))
    def walk(argv, env):
        code, stderr, ns = launch(argv, env)
        check_answer(command, argv, code, stderr, ns, files, env)

    walk()


def test_adapters_alone_turn_lora_on_with_their_slots_and_rank(files):
    """The issue's new user: `serve --lora-modules a=DIR` and nothing else."""
    def serve(*argv):
        code, stderr, ns = launch(["serve", "--port", str(free_port()), *argv])
        assert code == 0, stderr
        return ns

    ns = serve("--model", str(files["model"]), "--lora-modules", f"a={files['r32']}")
    assert (ns.max_loras, ns.max_lora_rank) == (1, 32)
    assert ns.implied == ["--lora-modules turns LoRA on: --max-loras 1",
                          f"--lora-modules a={files['r32']} has rank 32: --max-lora-rank 32"]
    ns = serve("--lora-modules", f"a={files['r8']}", f"b={files['r8']}")
    assert (ns.max_loras, ns.max_lora_rank) == (2, DEFAULT_MAX_LORA_RANK)
    ns = serve("--lora-dir", str(files["adapters"]))
    assert (ns.max_loras, ns.max_lora_rank) == (1, None)  # None: the engine's default, 16
    ns = serve("--lora-modules", *(f"a{i}={files['r8']}" for i in range(12)))
    assert ns.max_loras == INFERRED_MAX_LORAS
    ns = serve("--max-loras", "3", "--max-lora-rank", "64", "--lora-modules", f"a={files['r32']}")
    assert (ns.max_loras, ns.max_lora_rank) == (3, 64)  # given: kept
    ns = serve()
    assert (ns.max_loras, ns.max_lora_rank) == (0, None)  # no adapters: no LoRA


@pytest.mark.parametrize("argv, env, names", [
    (["serve", "--lora-modules", "a={r8}", "--max-loras", "0"], {}, "--max-loras 0"),
    (["serve", "--lora-modules", "a={r32}", "--max-lora-rank", "16"], {}, "--max-lora-rank 16"),
    (["serve", "--lora-modules", "a={missing}"], {}, "--lora-modules a="),
    (["serve", "--lora-modules", "a={r8}", "a={r32}"], {}, "'a' is given twice"),
    (["serve", "--lora-admin-key", "k"], {}, "--lora-dir"),
    (["serve", "--kv-cache-memory", "4X"], {}, "--kv-cache-memory"),
    (["serve", "--block-size", "24"], {}, "--block-size 24"),
    (["serve", "--model", "{missing}"], {}, "--model"),
    (["serve"], {"PAGEDSERVE_MAX_LORAS": "abc"}, "PAGEDSERVE_MAX_LORAS='abc' (the env var of --max-loras)"),
    (["serve"], {"PAGEDSERVE_DTYPE": "int4"}, "PAGEDSERVE_DTYPE"),
    (["router"], {"PAGEDSERVE_PORT": "abc"}, "PAGEDSERVE_PORT"),
    (["router", "--redis-url", "redis://r:1/0", "--port", "99999"], {}, "--port"),
    (["router", "--redis-url", "redis://r:1/0", "--discovery", "kubernetes"], {}, "--k8s-service"),
    (["router"], {}, "--redis-url"),
    (["engine", "--host", "0.0.0.0"], {}, "--internal-token-file"),
    (["engine", "--tensor-parallel-size", "4", "--tp-local-ranks", "3"], {}, "--tp-local-ranks 3"),
    (["engine-worker", "--tp-node-rank", "1"], {}, "--tp-rendezvous"),
    (["scheduler", "--engine", "localhost:7000"], {}, "--engine"),
    (["up", "--model", "a={model}", "--model", "b={model}", "--lora-modules", "x={r8}"], {}, "--lora-modules"),
    (["up", "--redis-url", "redis://r:1/0", "--redis-cluster", "3"], {}, "--redis-cluster"),
    (["convert", "--output", "{empty}", "--model", "{model}"], {}, "--model"),
    (["wait-for-disconnect", "--timeout", "1", "--engine", "tcp://engine:7000"], {}, "--engine"),
    (["generate", "--top-k", "-5", "hi"], {}, "--top-k"),
    (["bench", "serve", "--endpoint", "http://127.0.0.1:9", "--rates", "0"], {}, "--rates 0"),
    (["bench", "before-after", "--before", "no-such-revision-here"], {}, "--before"),
])
def test_a_command_line_that_cannot_work_is_one_line_naming_the_flag(argv, env, names, files):
    argv = [a.format(**files) for a in argv]
    code, stderr, _ = launch(argv, env)
    assert code == 2 and "Traceback" not in stderr, stderr
    assert len(stderr.strip().splitlines()) == 1 and names.format(**files) in stderr, stderr


@pytest.mark.parametrize("argv, env, names", [
    (["serve", "--lora-modules", "a=/nowhere/adapter", "--max-loras", "0"], {}, "--max-loras 0"),
    (["router"], {"PAGEDSERVE_MAX_QUEUE": "-3"}, "PAGEDSERVE_MAX_QUEUE"),
    (["engine", "--kv-cache-memory", "4X"], {}, "--kv-cache-memory"),
])
def test_the_real_command_exits_2_with_one_line(argv, env, names):
    """End to end, as a shell sees it: exit code 2, one stderr line, nothing on stdout, nothing started."""
    proc = subprocess.run([sys.executable, "-m", "services.commands.cli", *argv], capture_output=True, text=True,
                          timeout=120, env={**{k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")},
                                            **env})
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith(f"pagedserve {argv[0]}: error: ") and names in proc.stderr, proc.stderr


def test_a_redis_url_is_checked_without_showing_its_password():
    cluster = "redis://:s3cret@127.0.0.1:7001,127.0.0.1:7002,127.0.0.1:7003/0?cluster=true"  # `up --redis-cluster`'s
    code, stderr, ns = launch(["scheduler", "--port", str(free_port()), "--redis-url", cluster])
    assert code == 0 and ns.redis_url == cluster, stderr
    for env, argv in (({}, ["router", "--redis-url", "redis://:s3cret@h:port/0"]),
                      ({"PAGEDSERVE_REDIS_URL": "http://:s3cret@h:1/0"}, ["router"]),
                      ({"PAGEDSERVE_REDIS_URL": "redis://:s3cret@h:1,h:99999/0"}, ["scheduler"])):
        code, stderr, _ = launch(argv, env)
        assert code == 2 and "s3cret" not in stderr and ("--redis-url" in stderr or "PAGEDSERVE_REDIS_URL" in stderr)
