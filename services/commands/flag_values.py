"""The value types of the launcher's flags: what argparse calls on each flag's text (and on its env var's).

Each one returns the parsed value or raises `argparse.ArgumentTypeError` with a message saying what the
value must be, which argparse prints as `pagedserve <cmd>: error: argument --flag: <message>` with exit
code 2. A value that cannot work (a negative size, a port out of range, a URL without its port) is refused
here, before any process starts, instead of failing deep inside a service with a traceback.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from urllib.parse import urlparse

from services.contracts.byte_size import parse_bytes


class FlagError(ValueError):
    """A command line that cannot work, found by a rule that sees several flags (services.commands.flag_rules,
    services.commands.bench_flags); the message names the flags and says what to change."""


def flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _named(parse: Callable, name: str) -> Callable:
    parse.__name__ = name  # argparse names the type in its own messages ("invalid <name> value")
    return parse


def integer(low: int | None = None, high: int | None = None) -> Callable[[str], int]:
    """An integer in [low, high] (either end open when None)."""
    def parse(text: str) -> int:
        try:
            value = int(str(text).strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if (low is not None and value < low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {_bounds(low, high)}, got {value}")
        return value

    return _named(parse, "integer")


def positive_ints(text: str) -> list[int]:
    """A comma-separated list of integers >= 1 ("1,64")."""
    parse_one = integer(1)
    parts = [part for part in str(text).split(",") if part.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("needs at least one integer, e.g. 1,64")
    return [parse_one(part) for part in parts]


def number(low: float | None = None, *, above: bool = False, high: float | None = None) -> Callable[[str], float]:
    """A finite number >= low (> low with `above`), <= high."""
    def parse(text: str) -> float:
        try:
            value = float(str(text).strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if low is not None and (value <= low if above else value < low):
            raise argparse.ArgumentTypeError(f"must be {'>' if above else '>='} {low:g}, got {value:g}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be <= {high:g}, got {value:g}")
        return value

    return _named(parse, "number")


def _bounds(low: int | None, high: int | None) -> str:
    if low is not None and high is not None:
        return f"an integer in [{low}, {high}]"
    return f"an integer >= {low}" if low is not None else f"an integer <= {high}"


PORT = integer(1, 65535)


def byte_size(text: str) -> str:
    """A positive size in bytes ('4G', '512M', '1048576'); kept as written (services parse it again)."""
    try:
        value = parse_bytes(str(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive size in bytes, got {text!r}")
    return str(text).strip()


_named(byte_size, "size")


def boolean(text: str) -> bool:
    lowered = str(text).strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean (true/false, 1/0, yes/no, on/off)")


def url(*schemes: str, port: bool = True, host: bool = True) -> Callable[[str], str]:
    """A URL with one of `schemes`, with a host and a port unless told otherwise; kept as written."""
    def parse(text: str) -> str:
        text = str(text).strip()
        shown = ", ".join(f"{s}://" for s in schemes)
        try:
            parts = urlparse(text)
            given_port = parts.port if port else None  # raises ValueError when out of range or not a number
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{text!r} is not a valid URL ({exc})") from None
        if parts.scheme not in schemes:
            raise argparse.ArgumentTypeError(f"{text!r} must start with {shown}")
        if host and not parts.hostname:
            raise argparse.ArgumentTypeError(f"{text!r} names no host")
        if port and given_port is None:
            raise argparse.ArgumentTypeError(f"{text!r} names no port ({schemes[0]}://HOST:PORT)")
        if port and given_port == 0:
            raise argparse.ArgumentTypeError(f"{text!r}: the port must be in [1, 65535]")
        return text

    return _named(parse, "URL")


ENGINE_ADDRESS = url("tcp")
HTTP_URL = url("http", "https", port=False)


def redis_url(text: str) -> str:
    """redis://[:PASSWORD@]HOST[:PORT][,HOST:PORT...][/DB][?cluster=true], rediss://, unix://; its password
    never appears in a message (it comes from a Kubernetes Secret)."""
    from services.registry.redis_connect import redacted, startup_nodes

    text = str(text).strip()
    shown = redacted(text)
    scheme = urlparse(text).scheme
    if scheme not in ("redis", "rediss", "unix"):
        raise argparse.ArgumentTypeError(f"{shown!r} must start with redis://, rediss:// or unix://")
    if scheme != "unix":
        try:
            nodes = startup_nodes(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{shown!r}: every port must be a number") from None
        if any(not host or not 1 <= p <= 65535 for host, p in nodes):
            raise argparse.ArgumentTypeError(f"{shown!r}: every node is HOST:PORT with a port in [1, 65535]")
    return text


_named(redis_url, "Redis URL")
RENDEZVOUS = url("tcp", "file", port=False, host=False)


def rendezvous(text: str) -> str:
    """file:///path (ranks on one machine) or tcp://HOST:PORT (a group spanning machines)."""
    text = RENDEZVOUS(text)
    parts = urlparse(text)
    if parts.scheme == "tcp":
        return ENGINE_ADDRESS(text)
    if not parts.path:
        raise argparse.ArgumentTypeError(f"{text!r} names no file (file:///PATH)")
    return text


_named(rendezvous, "rendezvous")


def lora_module(text: str) -> str:
    """NAME=PATH (vLLM's spelling of --lora-modules)."""
    name, sep, path = str(text).partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=PATH")
    if name != name.strip() or not name.isprintable():
        raise argparse.ArgumentTypeError(f"{text!r}: the adapter name {name!r} has spaces or unprintable characters")
    return text


_named(lora_module, "NAME=PATH")


def non_empty(text: str) -> str:
    if not str(text).strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return str(text)


_named(non_empty, "text")
