"""Counting Triton compiles through Triton's public post-compile hook, for the GPU check's "no compile
while serving" row.

`triton.knobs.runtime.jit_post_compile_hook` is called after every JIT compile with the kernel's
function (JitFunctionInfo: module, name). The watch chains whatever hook was installed before it. A
Triton without that hook makes `CompileWatch.start()` raise, naming the version: the check then fails
loudly instead of reading a private cache layout that may have changed and counting 0. Under Triton's
interpreter nothing compiles, so every count is 0 there (the dry run says so).
"""

from __future__ import annotations

from collections import Counter


class CompileWatch:
    """Compiles per kernel name since start(); stop() restores the previous hook."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._runtime = None
        self._previous = None

    def start(self) -> CompileWatch:
        import triton

        runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
        if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
            raise RuntimeError(f"Triton {triton.__version__} has no triton.knobs.runtime.jit_post_compile_hook: "
                               "compiles cannot be counted through a public hook, so this check fails rather "
                               "than read Triton's private kernel caches")
        self._runtime, self._previous = runtime, runtime.jit_post_compile_hook
        runtime.jit_post_compile_hook = self._hook
        return self

    def stop(self) -> None:
        if self._runtime is not None:
            self._runtime.jit_post_compile_hook = self._previous
            self._runtime = None

    def _hook(self, *args, **kwargs):
        fn = kwargs.get("fn")
        self.counts[getattr(fn, "name", None) or repr(fn)] += 1
        if self._previous is not None:
            return self._previous(*args, **kwargs)
        return None

    def total(self) -> int:
        return sum(self.counts.values())

    def since(self, mark: Counter[str]) -> dict[str, int]:
        """Compiles per kernel after `mark` (a copy of `counts` taken earlier)."""
        return {k: n - mark.get(k, 0) for k, n in self.counts.items() if n > mark.get(k, 0)}
