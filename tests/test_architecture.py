"""The import graph matches docs/architecture.md: every import of every module (lazy ones inside
functions too) is checked against the document's table of forbidden arrows, and the router and the
scheduler services, imported in a fresh interpreter, load neither torch nor what they must not."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from services.commands.import_graph import imports_of, module_name, summary

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architecture.md"


def forbidden_arrows() -> dict[str, list[str]]:
    text = DOC.read_text()
    block = re.search(r"<!-- import-rules.*?-->(.*?)<!-- /import-rules -->", text, re.S)
    assert block, "docs/architecture.md lost its import-rules table"
    rules = {}
    for line in block.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 2 or not cells[0].startswith("`"):
            continue
        rules[cells[0].strip("`")] = [p.strip().strip("`") for p in cells[1].split(",")]
    assert len(rules) >= 10, rules
    return rules


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_the_import_graph_has_no_arrow_the_architecture_forbids():
    rules = forbidden_arrows()
    sources = sorted([*REPO.glob("services/**/*.py"), *REPO.glob("kernels/**/*.py")])
    assert len(sources) > 60
    violations = []
    for path in sources:
        mod = module_name(path)
        for owner, banned in rules.items():
            if not _under(mod, owner):
                continue
            for imported in imports_of(path):
                hit = [b for b in banned if _under(imported, b)]
                if hit:
                    violations.append(f"{mod} imports {imported} (forbidden for {owner}: {hit[0]})")
    assert not violations, "\n".join(sorted(set(violations)))


def test_the_tree_has_no_circle_and_no_arrow_back_up():
    """`make import-graph` prints the same graph; a circle between modules or rooms means some module
    lives in the wrong room."""
    graph = summary()
    assert graph["module_circles"] == [], graph["module_circles"]
    assert graph["room_circles"] == [], graph["room_circles"]
    assert graph["arrows_back_up"] == [], graph["arrows_back_up"]


def test_every_package_has_a_rule():
    """Every package, at any depth, is governed by a row (its own or an enclosing package's); only the
    assemblers (`services.commands`, the `services.bench` root) may import anything."""
    rules = forbidden_arrows()
    packages = {module_name(p.parent) for p in REPO.glob("services/**/__init__.py")}
    packages -= {"services", "services.commands", "services.bench"}
    ungoverned = {p for p in packages if not any(_under(p, owner) for owner in rules)}
    assert not ungoverned, f"packages without a rule in docs/architecture.md: {sorted(ungoverned)}"


def test_the_services_root_keeps_only_the_offline_api():
    loose = summary()["loose_modules_in_services_root"]
    assert loose == ["services.llm"], loose


@pytest.mark.parametrize("entry,banned", [
    ("services.commands.router", ["torch", "transformers", "services.scheduler", "services.engine",
                                  "services.replica", "kernels"]),
    ("services.commands.scheduler", ["torch", "transformers", "services.engine", "kernels"]),
])
def test_services_import_nothing_they_must_not_in_a_fresh_interpreter(entry, banned):
    code = (f"import json, sys, {entry}, services.commands.cli; services.commands.cli.build_parser(); "
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.splitlines()[-1])
    leaked = sorted({m for m in loaded for b in banned if _under(m, b)})
    assert not leaked, f"{entry} loads {leaked[:8]}"
