"""The GPU check's table (services/device_check/run.py and tensor_parallel.py): rows printed as they come
and appended to a file at once, so a run killed at its limit still returns what it measured; sections
that run on their own (one that raises becomes a FAILED row and the next section runs); errors named by
their type, never guessed from a message.

The run passes only if everything ran: a section skipped (the run's budget spent, or --force-skip), one
that overran its limit (SECTION_GRACE x its budget), a measurement skipped inside a section, and a planned
section that never reported are each a failure. Time limits are checked between sections and between
measurements, never by interrupting one: a signal landing inside a CUDA graph capture or a Triton compile
would break that section and every later one. A section past its limit is reported by a watchdog thread
(a line, nothing interrupted) and failed when it returns; a hung one is ended by whoever runs the check,
and the table file then lacks its verdict line, which every finished run writes last."""

from __future__ import annotations

import json
import math
import os
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

# A section past this multiple of its budget has timed out: failed (never interrupted; its own checks stop
# new measurements at 1x).
SECTION_GRACE = 1.5
VERDICT = "verdict:"  # the table file's last line starts with it once the run finished


@dataclass
class Row:
    section: str
    item: str
    value: str
    note: str = ""
    data: dict = field(default_factory=dict)


def describe_error(exc: BaseException) -> str:
    """`<type>: <first line>`: the exception's own type (torch.OutOfMemoryError, triton's
    CompilationError, RuntimeError...) and message, with nothing inferred from either."""
    kind = type(exc).__qualname__
    module = type(exc).__module__
    if module not in ("builtins", __name__):
        kind = f"{module.split('.')[0]}.{kind}"
    lines = str(exc).strip().splitlines()
    return f"{kind}: {lines[0][:200]}" if lines else kind


def default_table_path(name: str) -> Path:
    """Under $OUT when it is set (the device tool returns what is there), else the ignored .bench/."""
    out = os.environ.get("OUT")
    return Path(out) / name if out else Path(".bench") / name


class Report:
    """Rows, failures and per-section timings of one run; `table_path` gets each row as it is added.
    `plan(names)` declares the sections the run must complete; `force_skip` names sections to skip
    without running them (to prove that a skipped section fails the run)."""

    def __init__(self, budget_s: float, table_path: Path | None = None, title: str = "GPU check",
                 force_skip: frozenset[str] = frozenset()):
        self.rows: list[Row] = []
        self.failures: list[str] = []
        self.timings: list[dict] = []
        self.planned: list[str] = []
        self.finished: dict[str, str] = {}  # section -> "passed", "failed" or "skipped"
        self.force_skip = force_skip
        self.started = time.monotonic()
        self.deadline = self.started + budget_s
        self.section_deadline = math.inf
        self.table_path = table_path
        if table_path is not None:
            table_path.parent.mkdir(parents=True, exist_ok=True)
            table_path.write_text(f"# {title}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n\n"
                                  f"<!-- a finished run's last line starts with '{VERDICT}'; without it the run "
                                  "was stopped and proves nothing -->\n\n"
                                  "| section | check | result | note |\n|---|---|---|---|\n")

    def note(self, text: str) -> None:
        """A line above the table in the file (device, versions)."""
        print(text, flush=True)
        self._append(f"<!-- {text} -->\n")

    def _append(self, text: str) -> None:
        if self.table_path is None:
            return
        with open(self.table_path, "a") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    def add(self, section: str, item: str, value: str, note: str = "", **data) -> None:
        self.rows.append(Row(section, item, value, note, data))
        print(f"  {section:9s} {item:44s} {value:>16s}  {note}", flush=True)
        self._append(f"| {section} | {item} | {value} | {note.replace('|', '/')} |\n")

    def fail(self, what: str) -> None:
        self.failures.append(what)

    def plan(self, names: list[str]) -> None:
        """The sections this run must complete, each exactly once."""
        self.planned = list(names)
        self.note("planned sections: " + ", ".join(names))

    def out_of_time(self, what: str) -> bool:
        """True once this section's budget or the run's is spent: a 'skipped' row and a failure (a
        measurement not made is a check not passed)."""
        if time.monotonic() < min(self.deadline, self.section_deadline):
            return False
        self.add("skipped", what, "SKIPPED", "time budget spent")
        self.fail(f"{what}: not measured (time budget spent)")
        return True

    def _skip(self, name: str, why: str) -> bool:
        self.add(name, "section", "SKIPPED", why)
        self.fail(f"{name}: not run ({why})")
        self.finished[name] = "skipped"
        return False

    def section(self, name: str, budget_s: float, fn: Callable, *args) -> bool:
        """Run `fn(*args)` as one section within `budget_s`, never interrupting it; False when it failed,
        timed out or was skipped (each a failure of the run)."""
        now = time.monotonic()
        left = self.deadline - now
        if name in self.force_skip:
            return self._skip(name, "forced to skip (--force-skip)")
        if left < min(10.0, budget_s / 4):
            return self._skip(name, f"the run's time budget is spent (section budget {budget_s:.0f} s)")
        limit = min(budget_s * SECTION_GRACE, left)
        print(f"== {name} (time budget {budget_s:.0f} s, limit {limit:.0f} s)", flush=True)
        self.section_deadline = now + budget_s
        done = threading.Event()
        threading.Thread(target=_watch, args=(name, limit, done), daemon=True).start()
        ok = True
        try:
            fn(*args)
        except Exception as exc:  # any failure is this section's finding; the next section still runs
            traceback.print_exc()
            ok = False
            what = describe_error(exc)
            self.add(name, "FAILED", "FAILED", what)
            self.fail(f"{name}: {what}")
        finally:
            done.set()
            self.section_deadline = math.inf
            spent = time.monotonic() - now
            self.timings.append(dict(section=name, budget_s=budget_s, spent_s=round(spent, 1)))
            over = spent > limit
            self.add(name, "section time", f"{spent:.1f} s", f"budget {budget_s:.0f} s"
                     + (f" (TIMED OUT: past its limit of {limit:.0f} s)" if over else
                        " (over)" if spent > budget_s else ""), spent_s=spent, budget_s=budget_s)
            if over:
                ok = False
                self.fail(f"{name}: timed out ({spent:.0f} s, limit {limit:.0f} s)")
        self.finished[name] = "passed" if ok else "failed"
        return ok

    def verdict(self) -> list[str]:
        """Every failure, and every planned section that never reported (the run must complete them all)."""
        missing = [f"{n}: did not run" for n in self.planned if n not in self.finished]
        return self.failures + missing

    def finish(self) -> bool:
        """Print and write the verdict line (the table file's last); True when the run passed."""
        failures = self.verdict()
        line = f"{VERDICT} " + ("FAILED: " + "; ".join(failures) if failures else
                                f"all {len(self.planned)} planned sections ran and passed")
        print(line, flush=True)
        self._append(f"\n{line}\n")
        return not failures

    def print_table(self) -> None:
        widths = [max(len(getattr(r, f)) for r in self.rows) for f in ("section", "item", "value")]
        print("\n| " + " | ".join(("section".ljust(widths[0]), "check".ljust(widths[1]),
                                   "result".rjust(widths[2]), "note")) + " |")
        print("|" + "|".join("-" * (w + 2) for w in [*widths, 4]) + "|")
        for r in self.rows:
            print(f"| {r.section.ljust(widths[0])} | {r.item.ljust(widths[1])} | {r.value.rjust(widths[2])} | "
                  f"{r.note} |")

    def write_json(self, path: Path, **header) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            json.dump({**header, "failures": self.verdict(), "planned": self.planned, "finished": self.finished,
                       "timings": self.timings,
                       "rows": [asdict(r) for r in self.rows]}, f, indent=1, default=str)


def _watch(name: str, limit: float, done: threading.Event) -> None:
    """Say when a section passes its limit (it is not interrupted: it may be inside a graph capture)."""
    if not done.wait(limit):
        print(f"!! {name} is past its limit of {limit:.0f} s and still running: not interrupted (it may be "
              "capturing graphs or compiling); it fails when it returns", flush=True)
