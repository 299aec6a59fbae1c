"""One block size's block accesses as a few numpy arrays, for `cache analyze --ray`'s shared object.

A request's keys are stored as the prefix it shares with an earlier request (which one, how long)
plus its own new keys in one flat uint64 array, so a long session's keys are stored once, not once
a request: 40 synthetic sessions at block size 16 hold 19.2 M accesses but 0.8 M new keys. The
pickle is buffers (Ray maps them from its object store without copying), not 19 M Python ints, and
a worker unpacks to the very lists `block_accesses` made: equal keys, prefixes shared the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from agentkv.trace.accesses import BlockRequest


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two key lists (list equality runs in C, shared keys by identity)."""
    m = min(len(a), len(b))
    if a[:m] == b[:m]:
        return m
    lo, hi = 0, m  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _index(values: list) -> tuple[np.ndarray, list]:
    """`values` as indices into the list of its distinct values (sessions, stop reasons)."""
    names: dict = {}
    idx = np.fromiter((names.setdefault(v, len(names)) for v in values), np.int64, count=len(values))
    return idx, list(names)


@dataclass(eq=False)
class PackedRequests:
    """`BlockRequest`s as arrays: request i's keys are `requests[base[i]]`'s first `common[i]` keys
    (none when base is -1) followed by `keys[offsets[i]:offsets[i + 1]]`."""

    times: np.ndarray  # float64, each request's arrival and end
    ends: np.ndarray
    session: np.ndarray  # index into `sessions`
    sessions: list[str]
    input_tokens: np.ndarray  # int64
    output_tokens: np.ndarray
    stop: np.ndarray  # index into `stops`
    stops: list[str]
    last: np.ndarray  # bool
    base: np.ndarray  # int64: the earlier request whose prefix this one shares, or -1
    common: np.ndarray  # int64: how many of its keys
    offsets: np.ndarray  # int64, one more than requests
    keys: np.ndarray  # uint64: every request's new keys, in request order
    _unpacked: list[BlockRequest] | None = field(default=None, repr=False)

    @classmethod
    def pack(cls, requests: Sequence[BlockRequest]) -> PackedRequests:
        """Each request's longest shared prefix with the previous request of its session or the
        previous one that began with the same key (a sub-agent's system prompt), and its new keys."""
        n = len(requests)
        base, common = np.full(n, -1, np.int64), np.zeros(n, np.int64)
        offsets = np.zeros(n + 1, np.int64)
        by_session: dict[str, int] = {}
        by_first: dict[int, int] = {}
        new: list[int] = []
        for i, r in enumerate(requests):
            hs = r.hashes
            best, b = 0, -1
            for j in (by_session.get(r.session), by_first.get(hs[0]) if hs else None):
                if j is not None and j != b and (c := common_prefix(requests[j].hashes, hs)) > best:
                    best, b = c, j
            base[i], common[i] = b, best
            new += hs[best:]
            offsets[i + 1] = len(new)
            by_session[r.session] = i
            if hs:
                by_first[hs[0]] = i
        session, sessions = _index([r.session for r in requests])
        stop, stops = _index([r.stop for r in requests])
        return cls(
            np.array([r.time for r in requests], np.float64),
            np.array([r.end for r in requests], np.float64),
            session,
            sessions,
            np.array([r.input_tokens for r in requests], np.int64),
            np.array([r.output_tokens for r in requests], np.int64),
            stop,
            stops,
            np.array([r.last for r in requests], bool),
            base,
            common,
            offsets,
            np.array(new, np.uint64),
        )

    def __getstate__(self) -> dict:
        """The arrays only: a copy's unpacked lists are made where it is read."""
        return {k: v for k, v in self.__dict__.items() if k != "_unpacked"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _unpacked=None)

    def __len__(self) -> int:
        return len(self.times)

    def requests(self) -> list[BlockRequest]:
        """The `BlockRequest`s, made once per copy: a shared prefix is a slice of the base's list (its
        int objects shared), the new keys one `tolist` of the flat array."""
        if self._unpacked is not None:
            return self._unpacked
        flat, off = self.keys.tolist(), self.offsets.tolist()
        sessions, stops = self.sessions, self.stops
        lists: list[list[int]] = []
        out = []
        cols = (self.times, self.ends, self.session, self.input_tokens, self.output_tokens, self.stop)
        rows = zip(*(c.tolist() for c in (*cols, self.last, self.base, self.common)), strict=True)
        for i, (t, e, s, q, o, st, last, b, c) in enumerate(rows):
            hs = flat[off[i] : off[i + 1]]
            if b >= 0:
                hs = lists[b][:c] + hs
            lists.append(hs)
            out.append(BlockRequest(t, e, sessions[s], hs, q, o, stops[st], last))
        self._unpacked = out
        return out
