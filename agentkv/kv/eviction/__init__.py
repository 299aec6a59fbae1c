"""Eviction policies over a pool's free cached blocks, one module each; `make_policy` by name.

Adding a policy: a module here with an `Evictor` subclass, its name in `POLICIES` (and in
`ENGINE_POLICIES` if it needs no knowledge of the future), and a branch in `make_policy`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from agentkv.kv.eviction.base import ChunkQueue, Evictor, StampedEvictor
from agentkv.kv.eviction.lfu import LFU
from agentkv.kv.eviction.lru import LRU
from agentkv.kv.eviction.radix import RadixLRU

__all__ = [
    "ENGINE_POLICIES",
    "POLICIES",
    "ChunkQueue",
    "Evictor",
    "LFU",
    "LRU",
    "RadixLRU",
    "StampedEvictor",
    "make_policy",
]

POLICIES = ("lru", "lfu", "radix", "arc", "session", "belady")
ENGINE_POLICIES = ("lru", "lfu", "radix", "arc", "session")  # belady needs the future: offline only


def make_policy(name: str, *, accesses: Iterable[Sequence[int]] | None = None, **kwargs) -> Evictor:
    """A policy by name (one of POLICIES); "belady" needs the whole future `accesses` sequence."""
    if name == "belady":
        from agentkv.kv.eviction.belady import Belady

        if accesses is None:
            raise ValueError("the belady policy needs the access sequence (accesses=...)")
        return Belady(accesses)
    if name == "session":
        from agentkv.kv.eviction.session import SessionAware

        return SessionAware(**kwargs)
    if name == "arc":
        from agentkv.kv.eviction.arc import ARC

        return ARC(**kwargs)
    classes = {"lru": LRU, "lfu": LFU, "radix": RadixLRU}
    if name not in classes:
        raise ValueError(f"unknown eviction policy {name!r} (expected one of: {', '.join(POLICIES)})")
    return classes[name](**kwargs)
