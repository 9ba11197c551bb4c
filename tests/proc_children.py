"""Listing a process's children from /proc without racing its threads.

A thread can exit between listing /proc/PID/task and reading its `children` file (or a child can exit before
its cmdline is read); that is an ordinary outcome while ranks and pods come and go, not a test failure.
"""

from __future__ import annotations

from pathlib import Path


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None


def child_pids(pid: int) -> list[int]:
    """The live direct children of `pid`, over all its threads."""
    out: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except FileNotFoundError:
        return out
    for task in tasks:
        out += [int(child) for child in (_read(task / "children") or "").split()]
    return out


def descendant_pids(pid: int) -> set[int]:
    out: set[int] = set()
    for child in child_pids(pid):
        out |= {child} | descendant_pids(child)
    return out


def cmdline(pid: int) -> list[bytes] | None:
    """`pid`'s argv, or None once it has exited."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (FileNotFoundError, ProcessLookupError):
        return None
