"""The prefix-cache hit ceiling: the tokens an unbounded cache would serve. One definition, here.

A request hits the longest leading run of its keys that earlier requests of the same hash space
already brought (not itself), times the block size; then all its keys are cached. Three views
of it, which tests/test_ceiling.py checks agree:

- `CeilingTracker`: one request at a time, in replay order (bench and simulate, per request);
- `cache_hits` / `trace_hits`: whole traces at once, vectorised (`agentkv trace stats`);
- `ceiling_tokens`: on chained engine-block keys, counted as the pool counts hits (the last
  prompt token is recomputed), so `cache analyze` compares policies against it.
"""

from __future__ import annotations

import itertools
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from agentkv.kv.u64map import U64Map, as_keys
from agentkv.trace.model import Request, Trace, TraceError

if TYPE_CHECKING:
    from agentkv.trace.accesses import BlockRequest


class CeilingTracker:
    """`cache_hits` one request at a time, in replay order: what an unbounded cache would serve.

    Bench and simulate use it for the ceiling of the requests they actually replayed; `key`
    names the hash-id space (a trace, or a whole file for global ids). A space's seen ids live in a
    `U64Map`, whose compiled run finds a request's leading seen run (a set's `in`, id by id, took
    about 60 us a request, 6% of a `simulate` run); a space that meets an id outside [0, 2**64)
    keeps a set from then on.
    """

    def __init__(self) -> None:
        self._seen: dict[str, U64Map | set[int]] = {}
        self._last: dict[str, np.ndarray] = {}  # each space's latest request's keys, all seen since

    def hit_tokens(
        self, key: str, hash_ids: Sequence[int] | np.ndarray, input_tokens: int, block_size: int
    ) -> int:
        seen = self._seen.get(key)
        keys = as_keys(hash_ids) if type(seen) is not set else None
        if keys is not None:
            if seen is None:
                seen = self._seen[key] = U64Map(max(16, len(keys)))
            last, k = self._last.get(key), 0
            if last is not None:  # what it shares with the space's latest request is seen: a session's
                n = min(len(last), len(keys))  # next turn is checked in bulk, the map asked after that
                eq = last[:n] == keys[:n]
                k = n if eq.all() else int(eq.argmin())
            run = k + len(seen.run(keys[k:]))
            if run < len(keys):  # the run is in `seen` already: only the rest can add to it
                seen.setdefault_many(keys[run:], np.zeros(len(keys) - run, dtype=np.int64))
            self._last[key] = keys if keys.base is None else keys.copy()  # (the caller's array may change)
            return min(run * block_size, input_tokens)
        if type(seen) is not set:  # an id outside uint64: this space's ids as a set from now on
            seen = self._seen[key] = set() if seen is None else set(seen)
        run = len(list(itertools.takewhile(seen.__contains__, hash_ids)))  # the run already seen, in C
        if run < len(hash_ids):
            seen.update(hash_ids[run:] if run else hash_ids)
        return min(run * block_size, input_tokens)


def cache_hits(requests: Sequence[Request], block_size: int) -> np.ndarray:
    """Tokens an unbounded prefix cache serves to each request, given them in arrival order.

    A request hits the longest leading run of its hash ids that all appeared in earlier requests
    (not itself), times `block_size`, capped at its input tokens.
    """
    n = len(requests)
    out = np.zeros(n, dtype=np.int64)
    lens = np.fromiter((len(r.hash_ids) for r in requests), dtype=np.int64, count=n)
    total = int(lens.sum())
    if total == 0:
        return out
    try:
        ids = np.fromiter(itertools.chain.from_iterable(r.hash_ids for r in requests), np.int64, total)
    except OverflowError:  # ids past 2**63 (unsigned 64-bit hashes): renumber them in first-seen order
        index: dict[int, int] = {}
        ids = np.fromiter(
            (index.setdefault(h, len(index)) for r in requests for h in r.hash_ids), np.int64, total
        )
    top = int(ids.max())
    if top > 8 * total + (1 << 20):  # sparse ids (e.g. 64-bit hashes): renumber densely first
        ids = np.unique(ids, return_inverse=True)[1].astype(np.int64)
        top = int(ids.max())
    seen = np.zeros(top + 1, dtype=bool)
    ends = np.cumsum(lens)
    start = 0
    for i, end in enumerate(ends.tolist()):
        if end > start:
            block = ids[start:end]
            known = seen[block]
            run = end - start if known.all() else int(known.argmin())
            out[i] = min(run * block_size, requests[i].input_tokens)
            seen[block] = True
        start = end
    return out


def trace_hits(traces: Sequence[Trace]) -> list[int]:
    """Hit tokens per trace. Ids are local to a trace, except that `hash_id_scope == "global"`
    traces read from one file share one cache, their requests merged in time order."""
    hits = [0] * len(traces)
    shared: dict[str, list[int]] = defaultdict(list)
    for i, tr in enumerate(traces):
        if tr.hash_id_scope == "global":
            shared[tr.source or f"<trace {tr.id}>"].append(i)
        else:
            reqs = [x.request for x in tr.timeline()]
            hits[i] = int(cache_hits(reqs, tr.block_size).sum())
    for members in shared.values():
        sizes = {traces[i].block_size for i in members}
        if len(sizes) > 1:
            raise TraceError(
                traces[members[0]].source,
                None,
                "block_size",
                f"traces sharing global hash ids disagree on block size: {sorted(sizes)}",
            )
        merged = sorted(
            (
                (x.time, k, j, x.request)
                for k, i in enumerate(members)
                for j, x in enumerate(traces[i].timeline())
            ),
            key=lambda e: e[:3],
        )
        per_req = cache_hits([e[3] for e in merged], sizes.pop())
        for e, h in zip(merged, per_req.tolist(), strict=True):
            hits[members[e[1]]] += h
    return hits


def ceiling_tokens(requests: Sequence[BlockRequest], block_size: int) -> int:
    """Hit tokens of an unbounded cache on the same accesses, counted as the pool counts them.

    Each request hits its longest run of keys seen before, at most `(input_tokens - 1) // block_size`
    blocks (the last prompt token is recomputed); then all its keys are cached. No finite pool
    under any policy can beat it. Keys are chained, so key j seen implies keys 0..j seen: the run
    ends at the first unseen key, found by bisection.
    """
    seen: set[int] = set()
    hits = 0
    for r in requests:
        hs = r.hashes
        limit = max(0, min(len(hs), (r.input_tokens - 1) // block_size))
        n = bisect_left(range(limit), True, key=lambda j, hs=hs: hs[j] not in seen)
        hits += n * block_size
        seen.update(hs[n:])
    return hits
