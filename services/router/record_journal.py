"""A journal of the swaps of a router's replica records (router.replica_records): which replicas each swap
changed, so a reader keeping its own structure over the records (router.load_order) catches up in
O(changes), and watchers told of each swap as it happens.
"""

from __future__ import annotations

import logging
import weakref
from collections import deque
from collections.abc import Callable

log = logging.getLogger(__name__)

JOURNAL = 256  # swaps remembered: a reader further behind is told "unknown" and compares everything


class RecordJournal:
    def __init__(self) -> None:
        self.version = 0
        self._entries: deque[tuple[int, frozenset[str] | None]] = deque(maxlen=JOURNAL)
        self._watchers: list = []  # weak references to callables told of each swap

    def watch(self, callback: Callable[[], None]) -> None:
        """Call `callback` after each swap (weakly held when it is a bound method: a reader that goes away
        stops being called)."""
        self._watchers.append(weakref.WeakMethod(callback) if hasattr(callback, "__self__") else lambda: callback)

    def swapped(self, ids: frozenset[str] | None) -> None:
        """A swap happened that changed these replicas (None: any of them, e.g. some joined or left)."""
        self.version += 1
        self._entries.append((self.version, ids))
        live = []
        for ref in self._watchers:
            callback = ref()
            if callback is None:
                continue
            live.append(ref)
            try:
                callback()
            except Exception:  # a reader's bug must not stop the records from refreshing
                log.exception("a records watcher failed")
        self._watchers = live

    def changed_since(self, version: int) -> set[str] | None:
        """The replicas changed by the swaps after `version`, or None when that is unknown (a swap said
        "any", or `version` is older than the journal)."""
        if version == self.version:
            return set()
        entries = self._entries
        if version < 0 or not entries or entries[0][0] > version + 1:
            return None
        ids: set[str] = set()
        for v, changed in entries:
            if v > version:
                if changed is None:
                    return None
                ids |= changed
        return ids
