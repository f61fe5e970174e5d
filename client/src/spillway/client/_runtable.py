"""What a client process remembers per run and sidecar: values keyed by (target, job, run id),
shared by its threads, bounded (past `limit` entries the least recently set is forgotten and
that run falls back to the default behaviour). Used by `_pins` (a run's process) and `columns`
(whether a run's sidecar takes columns)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

Key = tuple[str, str, str]


class RunTable:
    def __init__(self, limit: int = 10_000) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._items: OrderedDict[Key, Any] = OrderedDict()

    def put(self, key: Key, value: Any) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.limit:
                self._items.popitem(last=False)

    def get(self, key: Key, default: Any = None) -> Any:
        with self._lock:
            return self._items.get(key, default)

    def pop(self, key: Key) -> None:
        with self._lock:
            self._items.pop(key, None)
