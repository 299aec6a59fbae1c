"""Eviction policies over a pool's free cached blocks, one module each; `make_policy` by name.

Kept import-light (the CLI lists the names): a policy's module is imported when it is made.
Adding a policy: a module here with an `Evictor` subclass and one line in `_CLASSES` (and in
`ENGINE_POLICIES` unless it needs to know the future, as Belady does).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agentkv.kv.eviction.base import Evictor

_CLASSES = {
    "lru": "lru:LRU",
    "lfu": "lfu:LFU",
    "radix": "radix:RadixLRU",
    "arc": "arc:ARC",
    "session": "session:SessionAware",
    "belady": "belady:Belady",
}
POLICIES = tuple(_CLASSES)
ENGINE_POLICIES = tuple(p for p in POLICIES if p != "belady")  # belady needs the future: offline only


def policy_class(name: str) -> type[Evictor]:
    """The `Evictor` subclass of a policy name (ValueError for an unknown one)."""
    if name not in _CLASSES:
        raise ValueError(f"unknown eviction policy {name!r} (expected one of: {', '.join(POLICIES)})")
    module, _, cls = _CLASSES[name].partition(":")
    return getattr(importlib.import_module(f"agentkv.kv.eviction.{module}"), cls)


def make_policy(name: str, *, accesses: Iterable[Sequence[int]] | None = None, **kwargs) -> Evictor:
    """A policy by name (one of POLICIES); "belady" needs the whole future `accesses` sequence."""
    cls = policy_class(name)
    if name == "belady":
        if accesses is None:
            raise ValueError("the belady policy needs the access sequence (accesses=...)")
        return cls(accesses)
    return cls(**kwargs)
