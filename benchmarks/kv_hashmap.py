"""The prefix cache's hash -> block upkeep: the dict `BlockPool` keeps against the alternatives
issue #15 asked about, on the churn an overloaded run makes (every block cached, then evicted).

A pool of `--blocks` blocks takes batches of `--batch` fresh 64-bit block hashes; once full, each
batch first evicts the oldest blocks. Each structure keeps hash -> block (with `setdefault`'s rule:
a hash already there keeps its block) and block -> hash:

- dict: `BlockPool`'s: `map(dict.setdefault)` in, `map(dict.__delitem__)` out, an object array
  of block hashes (agentkv.kv.pool_hashes).
- lazy dict: no deletes; an entry counts only while the uint64 mirror says its block still holds
  that hash; the map is rebuilt from the mirror when it reaches twice the live blocks.
- numpy probe: open addressing with linear probing in vectorised rounds, tombstones, rebuilt.
- numpy buckets: 4-slot buckets (one gather of a batch's rows), a delete clears the slot the
  block's entry sits in (no probing).
- U64Map: `BlockPool`'s map since 2026-12-05 (agentkv.kv.u64map): open addressing with linear
  probing, one compiled loop per batch (numba), deletes that move later entries back (no tombstones,
  rebuilt only to grow); its loops are loaded (or
  compiled) by a warm-up run before any timing.

Between batches `--pollute` MB of other memory is read, as the simulator's own work does (the
hash maps then miss the CPU caches as they do in `simulate`). Prints CPU ns per block cached and
per block evicted (best of `--repeat`), and checks that every structure maps what the dict maps.

Run: .venv/bin/python benchmarks/kv_hashmap.py [--blocks 56258] [--batch 420] [--pollute 64]
"""

from __future__ import annotations

import argparse
import os
import time
from collections import deque

import numpy as np

from agentkv.kv.u64map import U64Map

GOLDEN = np.uint64(0x9E3779B97F4A7C15)


class DictMap:
    """As `BlockPool`: a dict and an object array of each block's hash."""

    name = "dict (the pool's to 12-05)"

    def __init__(self, nb: int) -> None:
        self.map: dict[int, int] = {}
        self.bh = np.full(nb, None, dtype=object)

    def insert(self, hashes: list[int], keys: np.ndarray, blocks: np.ndarray) -> None:
        bl = blocks.tolist()
        self.fresh = list(map(self.map.setdefault, hashes, bl)) == bl  # False: copies to record
        self.bh[blocks] = np.fromiter(hashes, dtype=object, count=len(hashes))

    def drop(self, victims: np.ndarray) -> None:
        deque(map(self.map.__delitem__, self.bh[victims].tolist()), 0)
        self.bh[victims] = None

    def lookup(self, h: int) -> int | None:
        return self.map.get(h)


class InternedDict(DictMap):
    """The dict with one int object per block id (values never allocated or freed per block)."""

    name = "dict, interned block ids"

    def __init__(self, nb: int) -> None:
        super().__init__(nb)
        self.ids = list(range(nb))

    def insert(self, hashes: list[int], keys: np.ndarray, blocks: np.ndarray) -> None:
        bl = list(map(self.ids.__getitem__, blocks.tolist()))
        self.fresh = list(map(self.map.setdefault, hashes, bl)) == bl
        self.bh[blocks] = np.fromiter(hashes, dtype=object, count=len(hashes))


class LazyDict:
    """A dict whose stale entries stay until a rebuild; the mirror says which are current."""

    name = "lazy dict (no deletes)"

    def __init__(self, nb: int) -> None:
        self.map: dict[int, int] = {}
        self.bh = np.zeros(nb, dtype=np.uint64)
        self.has = np.zeros(nb, dtype=bool)
        self.nb = nb

    def insert(self, hashes: list[int], keys: np.ndarray, blocks: np.ndarray) -> None:
        if len(self.map) > 2 * self.nb:
            live = np.flatnonzero(self.has)
            self.map = dict(zip(self.bh[live].tolist(), live.tolist(), strict=True))
        bl = blocks.tolist()
        got = list(map(self.map.setdefault, hashes, bl))
        if got != bl:  # an entry left by an evicted block: this block takes the hash
            g = np.asarray(got)
            stale = (g != blocks) & ~(self.has[g] & (self.bh[g] == keys))
            for i in np.flatnonzero(stale).tolist():
                self.map[hashes[i]] = bl[i]
        self.bh[blocks] = keys
        self.has[blocks] = True

    def drop(self, victims: np.ndarray) -> None:
        self.has[victims] = False

    def lookup(self, h: int) -> int | None:
        b = self.map.get(h)
        return b if b is not None and self.has[b] and int(self.bh[b]) == h else None


class ProbeTable:
    """Open addressing, linear probing, in vectorised rounds; deletes leave tombstones (-2)."""

    name = "numpy probe"

    def __init__(self, nb: int) -> None:
        bits = (4 * nb - 1).bit_length()
        self.mask, self.shift = (1 << bits) - 1, np.uint64(64 - bits)
        self.keys = np.zeros(1 << bits, dtype=np.uint64)
        self.vals = np.full(1 << bits, -1, dtype=np.int64)
        self.slot = np.zeros(nb, dtype=np.int64)
        self.tombs, self.nb = 0, nb

    def insert(self, hashes: list[int], keys: np.ndarray, blocks: np.ndarray) -> None:
        if self.tombs > len(self.vals) // 2 - self.nb:
            live = np.flatnonzero(self.vals >= 0)
            k, v = self.keys[live], self.vals[live]
            self.vals[:] = -1
            self.tombs = 0
            self._put(k, v)
        self._put(keys, blocks)

    def _put(self, keys: np.ndarray, blocks: np.ndarray) -> None:
        pos = ((keys * GOLDEN) >> self.shift).astype(np.int64)
        todo = np.arange(len(keys))
        while len(todo):
            p = pos[todo]
            v = self.vals[p]
            found = (v >= 0) & (self.keys[p] == keys[todo])
            empty = np.flatnonzero(v == -1)
            self.vals[p[empty][::-1]] = -3 - todo[empty][::-1]  # claims: the first in the batch wins
            won = empty[self.vals[p[empty]] == -3 - todo[empty]]
            i = todo[won]
            self.keys[p[won]], self.vals[p[won]], self.slot[blocks[i]] = keys[i], blocks[i], p[won]
            lost = np.zeros(len(p), dtype=bool)
            lost[empty] = True
            lost[won] = False  # lost a claim: look at the same slot again (it may hold this hash)
            go = ~found & (v != -1)
            found[won] = True
            keep = go | lost
            pos[todo] = (p + go) & self.mask
            todo = todo[keep]

    def drop(self, victims: np.ndarray) -> None:
        self.vals[self.slot[victims]] = -2
        self.tombs += len(victims)

    def lookup(self, h: int) -> int | None:
        p = ((h * int(GOLDEN)) & ((1 << 64) - 1)) >> int(self.shift)
        while (v := int(self.vals[p])) != -1:
            if v >= 0 and int(self.keys[p]) == h:
                return v
            p = (p + 1) & self.mask
        return None


class BucketTable:
    """Buckets of 4 slots, one per live block on average; a batch reads its rows in one gather."""

    name = "numpy buckets"
    WAYS = 4

    def __init__(self, nb: int) -> None:
        bits = max(1, (nb - 1).bit_length())
        self.shift = np.uint64(64 - bits)
        self.keys = np.zeros((1 << bits, self.WAYS), dtype=np.uint64)
        self.vals = np.full((1 << bits, self.WAYS), -1, dtype=np.int64)
        self.slot = np.zeros(nb, dtype=np.int64)
        self.spill: dict[int, int] = {}  # a full bucket's overflow (rare), and its blocks' hashes
        self.spilled: dict[int, int] = {}
        self.in_spill = np.zeros(nb, dtype=bool)

    def insert(self, hashes: list[int], keys: np.ndarray, blocks: np.ndarray) -> None:
        todo = np.arange(len(keys))
        while len(todo):  # a round per batch member sharing a bucket with an earlier one
            k, b = keys[todo], blocks[todo]
            bk = (k >> self.shift).astype(np.int64)
            _, first = np.unique(bk, return_index=True)
            first.sort()
            rows = self.vals[bk[first]]
            there = ((rows >= 0) & (self.keys[bk[first]] == k[first, None])).any(1)
            new = first[~there]
            free = rows[~there] < 0
            col = free.argmax(1)
            full = ~free[np.arange(len(new)), col]
            for i in new[full].tolist():
                h, blk = hashes[todo[i]], int(b[i])
                if self.spill.setdefault(h, blk) == blk:
                    self.spilled[blk], self.in_spill[blk] = h, True
            new, col = new[~full], col[~full]
            flat = bk[new] * self.WAYS + col
            self.keys.reshape(-1)[flat], self.vals.reshape(-1)[flat] = k[new], b[new]
            self.slot[b[new]] = flat
            rest = np.ones(len(todo), dtype=bool)
            rest[first] = False
            todo = todo[rest]

    def drop(self, victims: np.ndarray) -> None:
        spilled = self.in_spill[victims]
        self.vals.reshape(-1)[self.slot[victims[~spilled]]] = -1
        for b in victims[spilled].tolist():
            del self.spill[self.spilled.pop(b)]
            self.in_spill[b] = False

    def lookup(self, h: int) -> int | None:
        r = int(np.uint64(h) >> self.shift)
        hit = (self.vals[r] >= 0) & (self.keys[r] == np.uint64(h))
        return int(self.vals[r][hit.argmax()]) if hit.any() else self.spill.get(h)


class U64Table:
    """`BlockPool`'s `U64Map` with the uint64 mirror that names an evicted block's key."""

    name = "U64Map (BlockPool's)"

    def __init__(self, nb: int) -> None:
        self.map = U64Map(nb)
        self.bh = np.zeros(nb, dtype=np.uint64)

    def insert(self, hashes: list[int], keys: np.ndarray, blocks: np.ndarray) -> None:
        self.map.setdefault_many(keys, blocks)
        self.bh[blocks] = keys

    def drop(self, victims: np.ndarray) -> None:
        self.map.delete_many(self.bh[victims])

    def lookup(self, h: int) -> int | None:
        return self.map.get(h)


CLASSES = {c.__name__: c for c in (DictMap, InternedDict, LazyDict, ProbeTable, BucketTable, U64Table)}


def churn(cls, nb: int, batch: int, stream: np.ndarray, pollute: np.ndarray) -> tuple[float, float, object]:
    """Replay the churn through one structure: (CPU s caching, CPU s evicting, the structure)."""
    m, hashes = cls(nb), stream.tolist()
    free, order = deque(range(nb)), deque()
    t_in = t_out = 0.0
    rng = np.random.default_rng(0)
    for lo in range(0, len(stream) - batch + 1, batch):
        if len(free) < batch:
            victims = np.array([order.popleft() for _ in range(batch - len(free))], dtype=np.int64)
            t = time.process_time()
            m.drop(victims)
            t_out += time.process_time() - t
            free.extend(victims.tolist())
        blocks = np.array([free.popleft() for _ in range(batch)], dtype=np.int64)
        order.extend(blocks.tolist())
        if len(pollute):
            start = int(rng.integers(0, len(pollute) - len(pollute) // 8))
            pollute[start : start + len(pollute) // 8].sum()
        t = time.process_time()
        m.insert(hashes[lo : lo + batch], stream[lo : lo + batch], blocks)
        t_in += time.process_time() - t
    return t_in, t_out, m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--blocks", type=int, default=56_258, help="pool blocks (Llama-3.1-8B on an H200: 56,258)"
    )
    ap.add_argument(
        "--batch", type=int, default=420, help="blocks cached per call (the overloaded run's mean)"
    )
    ap.add_argument("--rounds", type=int, default=20, help="pool turnovers")
    ap.add_argument(
        "--pollute", type=int, default=64, help="MB of other memory; 1/8 of it read between batches"
    )
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--only", default=",".join(CLASSES), help=f"comma-separated of {', '.join(CLASSES)}")
    args = ap.parse_args()
    if args.rounds < 2 or args.blocks < 1 or args.batch < 1:
        ap.error(
            "--rounds must be at least 2 (the first turnover only fills the pool), --blocks and --batch at least 1"
        )
    stream = np.random.default_rng(1).integers(0, 2**64 - 1, size=args.blocks * args.rounds, dtype=np.uint64)
    pollute = np.ones(args.pollute * (1 << 17), dtype=np.float64)
    print(
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; {args.blocks:,} blocks, batch {args.batch}"
    )
    ref = None
    names = args.only.split(",")
    unknown = [n for n in names if n not in CLASSES]
    if unknown:
        ap.error(f"--only: unknown {', '.join(unknown)} (known: {', '.join(CLASSES)})")
    if "U64Table" in names:  # load (or compile) its loops before any timing
        churn(U64Table, args.batch * 2, args.batch, stream[: args.batch * 6], pollute[:0])
    for cls in (CLASSES[n] for n in names):
        best = min(
            (churn(cls, args.blocks, args.batch, stream, pollute) for _ in range(args.repeat)),
            key=lambda r: r[0] + r[1],
        )
        t_in, t_out, m = best
        n = len(stream) // args.batch * args.batch
        live = stream[n - args.blocks : n].tolist() + stream[: args.blocks].tolist()
        got = [m.lookup(h) for h in live[:: max(1, len(live) // 4000)]]
        ref = ref or got
        ok = "same map" if got == ref else "DIFFERS from the dict"
        print(
            f"{cls.name:24} cache {t_in / n * 1e9:6.0f} ns/block  evict {t_out / (n - args.blocks) * 1e9:6.0f} ns/block"
            f"  total {(t_in + t_out) / n * 1e9:6.0f}  {ok}"
        )
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
