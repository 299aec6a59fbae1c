"""Prefix-lookup hints: finished requests' block tables, found again through the chained block keys
a new request shares with them, so its lookup is a bulk check (`BlockPool.get_computed_blocks`'s
`hint`) instead of a walk of the hash map. A hint only speeds a lookup up: the answer is the same.

A table is filed under its request's keys at a few depths (`ANCHORS`); a new request takes the
table filed under its deepest key found, which shares at least that many blocks with it. Unlike a
hint per session, this finds the right table when one session tree holds many prompts (sub-agents;
a Mooncake file, replayed as a single tree).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

ANCHORS = np.array([1, 4, 16, 64, 256, 1024, 4096, 16384, 65536], dtype=np.int64) - 1  # key positions


class PrefixHints:
    """Block tables filed by anchor keys, the latest table for a key kept, at most `limit` keys."""

    def __init__(self, limit: int = 16384) -> None:
        self.limit = limit
        self._tables: dict[int, np.ndarray] = {}

    def add(self, keys: np.ndarray, table: np.ndarray | None) -> None:
        """File `table` (a block table, never changed in place) under `keys`' anchors it covers."""
        if table is None:
            return
        n = min(len(keys), len(table))
        tables = self._tables
        for k in keys[ANCHORS[: np.searchsorted(ANCHORS, n)]].tolist():
            tables.pop(k, None)  # the latest table last: the oldest keys go first
            tables[k] = table
        while len(tables) > self.limit:
            del tables[next(iter(tables))]

    def get(self, keys: np.ndarray, holds: Callable[[int, int], bool] | None = None) -> np.ndarray | None:
        """The table filed under the deepest of `keys`' anchors, or None; with `holds(block, key)`
        (the pool still maps key -> block), the deepest whose first block and anchor block hold."""
        get = self._tables.get
        pos = ANCHORS[: np.searchsorted(ANCHORS, len(keys))]
        first = int(keys[0]) if len(pos) else 0
        for p, k in zip(reversed(pos.tolist()), reversed(keys[pos].tolist()), strict=True):
            table = get(k)
            if table is not None and (holds is None or (holds(table[0], first) and holds(table[p], k))):
                return table
        return None
