"""Child processes of a command: `up`'s cluster and `serve`'s engine.

Each child dies with its parent (Linux's PR_SET_PDEATHSIG; the signal comes when the *thread* that
started it exits, so start children from a long-lived thread) and has its own process group, so a
terminal's Ctrl-C reaches the parent, which stops its children in order. Flags are passed through
from the parent's own parsed options (services.commands.settings), exactly as Kubernetes would pass them.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

# The options an engine child inherits from `up` or `serve`.
ENGINE_FLAGS = ["model", "dtype", "device", "block_size", "num_kv_blocks", "kv_cache_memory", "max_model_len",
                "attention_backend", "enforce_eager", "max_num_seqs", "tensor_parallel_size", "tp_timeout", "max_loras",
                "max_lora_rank", "max_cpu_loras", "speculative_config", "log_level"]


def die_with_parent() -> None:
    """Linux: the child gets SIGTERM if `up` itself dies without cleaning up (e.g. SIGKILL)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    os.setsid()  # own process group: a terminal's Ctrl-C reaches `up`, which stops children in order


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    restarts: int = 0
    quiet: bool = False  # drop its stdout (redis-server's banner)
    stdin: str | None = None  # written to its stdin at start (redis-server's secret config)

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, env={**os.environ, **self.env}, preexec_fn=die_with_parent,
                                     stdout=subprocess.DEVNULL if self.quiet else None,
                                     stdin=subprocess.PIPE if self.stdin is not None else None, text=True)
        if self.stdin is not None:
            self.proc.stdin.write(self.stdin)
            self.proc.stdin.close()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive:
            self.proc.send_signal(sig)

    def wait(self, timeout: float) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in %.0fs; killing it", self.name, timeout)
            self.proc.kill()
            self.proc.wait()


def flags(args, names: list[str]) -> list[str]:
    """Pass through the options the user gave (None means: leave the service's default)."""
    out = []
    for name in names:
        value = getattr(args, name, None)
        if value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):  # nargs="+" options, e.g. --lora-modules A=/a B=/b
            out += [flag, *map(str, value)]
        else:
            out += [flag, str(value)]
    return out
