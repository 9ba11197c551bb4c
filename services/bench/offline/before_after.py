"""`pagedserve bench before-after`: this checkout's `bench throughput` against an earlier revision's, in one run.

A change that claims to cost the default path nothing is measured here: the earlier revision is checked
out into a temporary git worktree, and the two run `bench throughput` (same arguments, same interpreter
and virtualenv, one after the other, alternating, so a change in the machine's load lands on both alike).
Printed per run and as the ratio of medians: output tokens/s and the scheduler's own milliseconds per step
at 256 running requests (a model-free figure, steadier than tokens/s on a shared machine).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def _git(*argv: str, cwd: Path) -> str:
    return subprocess.run(["git", *argv], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def check_flags(args) -> None:
    """--before names a commit of this checkout, and the arguments after `--` are `bench throughput`'s
    (refused while the command line is parsed: services.commands.flag_rules)."""
    from services.commands.cli import build_parser
    from services.commands.flag_values import FlagError

    proc = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{args.before}^{{commit}}"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise FlagError(f"--before {args.before}: not a commit of this checkout (git rev-parse --verify)")
    build_parser().parse_args(["bench", "throughput", *_throughput_args(args)])


def _throughput_args(args) -> list[str]:
    bench_args = list(args.bench_args)
    return bench_args[1:] if bench_args[:1] == ["--"] else bench_args


def _one(checkout: Path, bench_args: list[str], out: Path) -> dict:
    # Each checkout imports its own `services` (cwd first on the path), with this interpreter's packages.
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    cmd = [sys.executable, "-m", "services.commands.cli", "bench", "throughput", *bench_args, "--against", "none",
           "--json", str(out)]
    proc = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"bench throughput failed in {checkout} ({proc.returncode}):\n{proc.stderr[-3000:]}")
    report = json.loads(out.read_text())
    return {"tokens_per_s": report["results"][0]["tokens_per_s"],
            "scheduler_ms_per_step": report.get("scheduler_ms_per_step_at_256_running")}


def run(args) -> int:
    here = Path(_git("rev-parse", "--show-toplevel", cwd=Path.cwd()))
    before_rev = _git("rev-parse", "--short", args.before, cwd=here)
    after_rev = _git("rev-parse", "--short", "HEAD", cwd=here)
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no", cwd=here))
    bench_args = _throughput_args(args)
    tmp = Path(tempfile.mkdtemp(prefix="pagedserve-before-"))
    # One checkout path per revision, reused by later commands: the C++ kernels' build key includes their
    # directory, so a fresh path per command would rebuild them (minutes on two cores) every time.
    before = Path(tempfile.gettempdir()) / f"pagedserve-before-{before_rev}"
    if before.exists():
        _git("worktree", "remove", "--force", str(before), cwd=here)
    _git("worktree", "add", "--detach", str(before), before_rev, cwd=here)
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    try:
        for i in range(args.runs):
            for name, checkout in (("before", before), ("after", here)):
                r = _one(checkout, bench_args, tmp / f"{name}-{i}.json")
                runs[name].append(r)
                print(f"  run {i + 1}/{args.runs} {name:<6} ({before_rev if name == 'before' else after_rev}): "
                      f"{r['tokens_per_s']:8.1f} output tok/s, scheduler {r['scheduler_ms_per_step']:.3f} ms/step "
                      f"at 256 running", flush=True)
    finally:
        _git("worktree", "remove", "--force", str(before), cwd=here)
        shutil.rmtree(tmp, ignore_errors=True)
    report = {"before": before_rev, "after": after_rev + ("+uncommitted" if dirty else ""),
              "bench_args": bench_args, "machine": f"{platform.machine()}, {os.cpu_count()} cores", "runs": runs}
    for key in ("tokens_per_s", "scheduler_ms_per_step"):
        b = statistics.median(r[key] for r in runs["before"])
        a = statistics.median(r[key] for r in runs["after"])
        report[f"{key}_after_over_before"] = round(a / b, 3)
    print(f"after/before, medians of {args.runs} alternating runs: output tok/s "
          f"{report['tokens_per_s_after_over_before']:.3f}x, scheduler ms/step "
          f"{report['scheduler_ms_per_step_after_over_before']:.3f}x (below 1: faster)", flush=True)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2))
    return 0
