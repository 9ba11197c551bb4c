"""The tree's import graph: rooms (packages), arrows between them, circles, arrows back up.

`python -m services.commands.import_graph` (or `make import-graph`) prints it; `tests/test_architecture.py`
checks the same graph against docs/architecture.md's forbidden arrows. Every import counts, lazy ones
inside functions included, since a lazy import is still an arrow the reader has to follow.

- A *room* is a package (a directory with `__init__.py`); the loose modules of `services/` sit in the
  `services` room, the hallway.
- An *arrow* is an import from a module of one room to a module of another (each pair counted once per
  module pair).
- A *circle* is a set of modules each reachable from every other one; a room circle, the same between
  rooms, where a package and its own subpackages count as one house (the engine's `lora/` may use the
  engine's `tp_shard` while the engine uses `lora/`: no circle).
- An *arrow back up* is an import from a room into one of its ancestor rooms whose target module
  (transitively) imports the importing module again: the child needs a parent that needs the child.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("services", "kernels")


def module_name(path: Path, repo: Path = REPO) -> str:
    parts = list(path.relative_to(repo).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, repo: Path = REPO) -> set[str]:
    """Every module `path` imports, absolute, wherever in the file the import statement is (a `from X
    import y` yields both X and X.y, since y may be a module)."""
    name = module_name(path, repo)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return found


def source_files(repo: Path = REPO) -> list[Path]:
    return sorted(p for root in ROOTS for p in (repo / root).glob("**/*.py"))


def module_graph(repo: Path = REPO) -> tuple[dict[str, Path], dict[str, set[str]]]:
    """The project's modules and, for each, the project modules it imports."""
    files = {module_name(p, repo): p for p in source_files(repo)}
    edges: dict[str, set[str]] = {}
    for mod, path in files.items():
        edges[mod] = {imp for imp in imports_of(path, repo) if imp in files and imp != mod}
    return files, edges


def room_of(mod: str, files: dict[str, Path]) -> str:
    """A package is its own room; a module lives in its package's room."""
    return mod if files[mod].name == "__init__.py" else mod.rpartition(".")[0]


def strongly_connected(nodes: list[str], edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of more than one node, iteratively (the module graph is deep enough to
    threaten recursion limits in a bad tree)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def reachable(start: str, edges: dict[str, set[str]]) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in edges.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def summary(repo: Path = REPO) -> dict:
    files, edges = module_graph(repo)
    rooms: dict[str, list[str]] = defaultdict(list)
    for mod in files:
        rooms[room_of(mod, files)].append(mod)
    arrows: dict[tuple[str, str], int] = defaultdict(int)
    for mod, targets in edges.items():
        for target in targets:
            a, b = room_of(mod, files), room_of(target, files)
            if a != b and not (files[target].name == "__init__.py" and b == target and a.startswith(b + ".")):
                arrows[(a, b)] += 1
    room_edges: dict[str, set[str]] = defaultdict(set)
    for a, b in arrows:
        if not (a.startswith(b + ".") or b.startswith(a + ".")):
            room_edges[a].add(b)
    room_circles = strongly_connected(sorted(rooms), room_edges)
    back_up = sorted(
        f"{mod} -> {target}"
        for mod, targets in edges.items() for target in targets
        if (a := room_of(mod, files)) != (b := room_of(target, files)) and a.startswith(b + ".")
        and mod in reachable(target, edges))
    loose = sorted(m for m in rooms.get("services", []) if m != "services")
    return {
        "modules": len(files),
        "rooms": {r: len(ms) for r, ms in sorted(rooms.items())},
        "loose_modules_in_services_root": loose,
        "arrows": {f"{a} -> {b}": n for (a, b), n in sorted(arrows.items())},
        "module_circles": strongly_connected(sorted(files), edges),
        "room_circles": room_circles,
        "arrows_back_up": back_up,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--json", action="store_true", help="print the whole graph as JSON")
    args = parser.parse_args(argv)
    s = summary()
    if args.json:
        print(json.dumps(s, indent=1))
        return 0
    print(f"modules: {s['modules']}   rooms: {len(s['rooms'])}   arrows between rooms: {len(s['arrows'])}")
    print(f"loose modules in services/: {len(s['loose_modules_in_services_root'])} "
          f"({', '.join(m.split('.')[-1] for m in s['loose_modules_in_services_root'])})")
    print(f"module circles: {len(s['module_circles'])}")
    for comp in s["module_circles"]:
        print("  " + " <-> ".join(comp))
    print(f"room circles: {len(s['room_circles'])}")
    for comp in s["room_circles"]:
        print("  " + " <-> ".join(comp))
    print(f"arrows back up: {len(s['arrows_back_up'])}")
    for arrow in s["arrows_back_up"]:
        print("  " + arrow)
    print("rooms (modules): " + ", ".join(f"{r} ({n})" for r, n in s["rooms"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
