"""An order-free digest of a set of block hashes: lets a test compare a router's index of a worker
with the worker's own cache (`/debug/index` vs `/debug/kv_blocks`) without shipping the hashes."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable


def block_digest(hashes: Iterable[int]) -> dict:
    """`{"blocks": n, "digest": hex}`: equal sets give equal digests; the hashes cannot be read back."""
    ordered = sorted(set(hashes))
    h = hashlib.sha256(",".join(map(str, ordered)).encode())
    return {"blocks": len(ordered), "digest": h.hexdigest()[:32]}
