"""The C heap under a CPU engine: step tensors reused from the heap, not mapped and faulted in every step.

PyTorch's CPU allocator is glibc's malloc. A step's larger tensors (a 2,048-token step's gate_up output
is 12 MB, its logits and attention buffers megabytes) sit above glibc's mmap threshold, so each one is a
fresh mmap whose pages the kernel faults in and zeroes on first touch, and a munmap when freed; and
memory freed at the top of the heap is trimmed back to the kernel, to be faulted in again. On a 2-core
Intel Xeon VM a W2 run of the bundled model took 0.5-1.4 million page faults this way, 19-40 thousand
with the threshold and the trim held high, and ran 4-7% faster (`bench throughput --workload w2`,
alternating runs). vLLM's CPU backend preloads tcmalloc for the same reason (where its wheel bundles it; the
vLLM 0.32 wheel measured against here does not); setting glibc's own two
knobs needs no library in the image and no re-exec.

`tune_cpu_heap()` runs once per engine process on a CPU device, before the weights load. A libc without
`mallopt` (musl) or an explicit MALLOC_*/GLIBC_TUNABLES setting leaves the allocator as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os

log = logging.getLogger(__name__)

# glibc's mallopt parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# glibc caps the mmap threshold at HEAP_MAX_SIZE / 2: 32 MiB on 64-bit. Tensors above it (the KV cache,
# the weights) stay mappings of their own; everything a step allocates and frees comes from the heap.
MMAP_THRESHOLD = 32 << 20
# Free memory at the top of the heap kept, not returned: a step's peak of transient tensors is well
# under this, and returning it only to fault it back next step is the cost being removed.
TRIM_THRESHOLD = 1 << 30


@functools.cache  # once per process: later calls (every tensor-parallel rank's runner) return the first answer
def tune_cpu_heap() -> bool:
    """Hold glibc's mmap and trim thresholds high for this process. True when they were set."""
    if any(k.startswith("MALLOC_") for k in os.environ) or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        log.info("C heap: MALLOC_*/GLIBC_TUNABLES set in the environment, left as given")
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # not glibc (musl has no mallopt): nothing to tune
        log.info("C heap: no mallopt in %s, left as it is", name)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if ok:
        log.info("C heap: allocations under %d MiB from the heap, %d MiB of free heap kept (mallopt)",
                 MMAP_THRESHOLD >> 20, TRIM_THRESHOLD >> 20)
    else:
        log.warning("C heap: mallopt refused the thresholds; step tensors stay mapped per allocation")
    return ok
