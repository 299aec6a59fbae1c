"""A request's block table grown in place: the head of a buffer that doubles when full, so a new
block does not copy the whole table (a long context's holds thousands), while tables handed out
earlier (lookup hints, `block_table`) keep their length and content. The dense pool keeps one such
buffer a request, the hybrid pool one a request and group."""

from __future__ import annotations

import numpy as np


def appended(buf: np.ndarray | None, table: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`table` (the head of `buf`, or any table when `buf` is None) with `new` appended: (the buffer,
    a new one twice what is needed when None or full; the longer table, its head). Only the tail is
    written."""
    n, k = len(table), len(new)
    if buf is None or n + k > len(buf):
        buf = np.empty(2 * (n + k), dtype=np.int64)
        buf[:n] = table
    buf[n : n + k] = new
    return buf, buf[: n + k]
