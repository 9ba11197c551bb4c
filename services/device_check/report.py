"""The GPU check's table (services/device_check/run.py and gpu_check_tp.py): rows printed as they come
and appended to a file at once, so a run killed at its limit still returns what it measured; sections
that run on their own (one that raises or overruns its time budget becomes a FAILED row and the next
section runs); errors named by their type, never guessed from a message."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

# A section is interrupted at this multiple of its budget (its own checks stop new measurements at 1x).
SECTION_GRACE = 1.5


@dataclass
class Row:
    section: str
    item: str
    value: str
    note: str = ""
    data: dict = field(default_factory=dict)


class SectionTimeout(Exception):
    """A section ran past its hard limit (SECTION_GRACE times its budget, or the run's deadline)."""


def describe_error(exc: BaseException) -> str:
    """`<type>: <first line>`: the exception's own type (torch.OutOfMemoryError, triton's
    CompilationError, RuntimeError...) and message, with nothing inferred from either."""
    kind = type(exc).__qualname__
    module = type(exc).__module__
    if module not in ("builtins", __name__):
        kind = f"{module.split('.')[0]}.{kind}"
    lines = str(exc).strip().splitlines()
    return f"{kind}: {lines[0][:200]}" if lines else kind


@contextlib.contextmanager
def _hard_limit(seconds: float):
    """Raise SectionTimeout in the main thread after `seconds` (no limit elsewhere, or for <= 0)."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(signum, frame):
        raise SectionTimeout(f"stopped after {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def default_table_path(name: str) -> Path:
    """Under $OUT when it is set (the device tool returns what is there), else the ignored .bench/."""
    out = os.environ.get("OUT")
    return Path(out) / name if out else Path(".bench") / name


class Report:
    """Rows, failures and per-section timings of one run; `table_path` gets each row as it is added."""

    def __init__(self, budget_s: float, table_path: Path | None = None, title: str = "GPU check"):
        self.rows: list[Row] = []
        self.failures: list[str] = []
        self.timings: list[dict] = []
        self.started = time.monotonic()
        self.deadline = self.started + budget_s
        self.section_deadline = math.inf
        self.table_path = table_path
        if table_path is not None:
            table_path.parent.mkdir(parents=True, exist_ok=True)
            table_path.write_text(f"# {title}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n\n"
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

    def out_of_time(self, what: str) -> bool:
        """True (and a 'skipped' row) once this section's budget or the run's is spent."""
        if time.monotonic() < min(self.deadline, self.section_deadline):
            return False
        self.add("skipped", what, "-", "time budget spent")
        return True

    def section(self, name: str, budget_s: float, fn: Callable, *args) -> bool:
        """Run `fn(*args)` as one section within `budget_s`; False when it failed or was skipped."""
        now = time.monotonic()
        left = self.deadline - now
        if left < min(10.0, budget_s / 4):
            self.add(name, "section", "SKIPPED", f"the run's time budget is spent (budget {budget_s:.0f} s)")
            return False
        print(f"== {name} (time budget {budget_s:.0f} s)", flush=True)
        self.section_deadline = now + budget_s
        ok = True
        try:
            with _hard_limit(min(budget_s * SECTION_GRACE, left)):
                fn(*args)
        except Exception as exc:  # any failure is this section's finding; the next section still runs
            traceback.print_exc()
            ok = False
            what = describe_error(exc)
            self.add(name, "FAILED", "FAILED", what)
            self.fail(f"{name}: {what}")
        finally:
            self.section_deadline = math.inf
            spent = time.monotonic() - now
            self.timings.append(dict(section=name, budget_s=budget_s, spent_s=round(spent, 1)))
            self.add(name, "section time", f"{spent:.1f} s", f"budget {budget_s:.0f} s"
                     + (" (over)" if spent > budget_s else ""), spent_s=spent, budget_s=budget_s)
        return ok

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
            json.dump({**header, "failures": self.failures, "timings": self.timings,
                       "rows": [asdict(r) for r in self.rows]}, f, indent=1, default=str)
