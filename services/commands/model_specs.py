"""The models `pagedserve up` serves: `--model` repeated, each `PATH`, `NAME=PATH` or `NAME=PATH:REPLICAS`.

A plain `PATH` (or none: the bundled model) is the single-model form, named by --served-model-name as
before. Several models each need a NAME (the `model` clients send); REPLICAS defaults to --replicas.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")


@dataclass(frozen=True)
class ModelSpec:
    name: str | None  # served model name (None: the engine's own model id)
    path: str | None  # Hugging Face directory or .gguf file (None: the bundled model)
    replicas: int


def parse_model_specs(models: str | list[str] | None, replicas: int,
                      served_model_name: str | None = None) -> list[ModelSpec]:
    """Raises ValueError naming the entry at fault."""
    if replicas < 1:
        raise ValueError(f"--replicas must be at least 1, not {replicas}")
    entries = [models] if models is None or isinstance(models, str) else list(models)
    if len(entries) == 1 and (entries[0] is None or not _named(entries[0])):
        return [ModelSpec(served_model_name, entries[0], replicas)]
    if served_model_name is not None:
        raise ValueError("--served-model-name names a single model; with several, name each as --model NAME=PATH")
    specs = []
    for entry in entries:
        if entry is None or not _named(entry):
            raise ValueError(f"--model {entry}: with several models, each is NAME=PATH or NAME=PATH:REPLICAS")
        name, path = entry.split("=", 1)
        count = replicas
        head, sep, tail = path.rpartition(":")
        if sep and tail.isdigit():
            path, count = head, int(tail)
        if not _NAME.match(name):
            raise ValueError(f"--model {entry}: the name {name!r} is not a valid model name")
        if not path:
            raise ValueError(f"--model {entry}: no path after {name}=")
        if count < 1:
            raise ValueError(f"--model {entry}: replicas must be at least 1")
        specs.append(ModelSpec(name, path, count))
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"--model: a model name is given twice ({', '.join(names)})")
    return specs


def _named(entry: str) -> bool:
    """NAME=PATH, as opposed to a path that happens to hold '=' (it would have a '/' before it)."""
    name, sep, _ = entry.partition("=")
    return bool(sep) and "/" not in name
