"""When waiting requests may join the running batch: the admission policy of a serving system.

Iteration-level (Orca, pagedserve): at every step, as far as blocks and the token budget allow.
Request-level (FasterTransformer's static batching): a batch is formed when nothing runs, runs until its
last member finishes, and only then are new requests admitted; its members' KV is still released the
moment each one finishes (every block comes back), it just is not given to anyone until the batch ends.
"""

from __future__ import annotations

import enum


class Batching(enum.Enum):
    ITERATION = "iteration"
    REQUEST = "request"

    def admits(self, num_running: int) -> bool:
        """May this step admit waiting requests, given how many sequences were running when it began?"""
        return self is Batching.ITERATION or num_running == 0
