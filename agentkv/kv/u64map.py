"""`U64Map`: a hash -> block map for uint64 block hashes, kept in two numpy arrays (open addressing,
linear probing) and updated a batch at a time by compiled loops (numba).

`BlockPool` caches and evicts every block through its map; as a dict each insert and delete waits on
memory (the dict's slots and the hash int objects: 240-275 ns a block inside `simulate`), where one
compiled loop over a batch's uint64 hashes costs 30-60 ns a block (docs/simulate.md, "A compiled
probe loop"). It also answers the dict calls the rest of the code makes (`get`, `in`, `[]`, `del`,
`items()`, ...), so readers see a mapping; only the pool's hot paths use the batch calls.
Key 0 marks an empty slot, so that hash lives in a small side dict. A delete moves later entries
back instead of leaving a mark, so the table is rebuilt only to grow (`u64map_loops`).
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping

import numpy as np

_MUL = 0x9E3779B97F4A7C15  # u64map_loops.MUL: the slot is the top bits of key x _MUL
_M64 = (1 << 64) - 1
_L = None  # agentkv.kv.u64map_loops, imported with the first map (numba's import and load: about 0.4 s)


def _loops():
    """The compiled loops' module, each loop called once on a tiny table: numba loads (or compiles) a
    loop at its first call, and that 0.2-0.7 s belongs to making the first map, not to a running
    engine's first step (an embedded server's engine fell behind real time by it)."""
    global _L
    if _L is None:
        from agentkv.kv import u64map_loops as loops

        keys, vals, ks = np.zeros(16, np.uint64), np.zeros(16, np.int64), np.arange(2, 4, dtype=np.uint64)
        shift, out = np.uint64(60), np.empty(2, np.int64)
        loops.setdefault_many(keys, vals, ks, np.zeros(2, np.int64), shift, 15, out)
        loops.run(keys, vals, ks, shift, 15, out)
        loops.assign_many(keys, vals, ks, np.zeros(2, np.int64), shift, 15)
        loops.hinted_run(
            keys, vals, ks, 2, np.zeros(2, np.int64), 2, np.zeros(16, bool), keys, shift, 15, out
        )
        loops.delete_many(keys, vals, ks, shift, 15)
        _L = loops
    return _L


def as_keys(hashes) -> np.ndarray | None:
    """Hashes as a uint64 key array, or None when one is not an int in [0, 2**64) (a map that gets
    such a hash becomes a dict). An integer array is taken as it is (a view when 64-bit: keep a copy
    if it may change); its negative values are refused, as in a list, where numpy would wrap them."""
    if isinstance(hashes, np.ndarray) and hashes.dtype.kind in "iu":
        if hashes.dtype.kind == "i" and len(hashes) and hashes.min() < 0:
            return None
        return hashes.view(np.uint64) if hashes.dtype.itemsize == 8 else hashes.astype(np.uint64)
    try:
        return np.array(hashes, dtype=np.uint64)
    except (OverflowError, TypeError, ValueError):
        return None


class U64Map(MutableMapping):
    """uint64 -> int map (block hash -> block id) with compiled batch calls beside the dict API.

    Sized for `capacity` live keys (the pool's blocks); it grows past that and rebuilds itself when
    Iteration order is slot order, not insertion order.
    """

    def __init__(self, capacity: int = 64) -> None:
        _loops()  # (kept in the module, not on the map: a map pickles as its arrays)
        self._side: dict[int, int] = {}  # key 0 (the empty-slot mark)
        self._alloc(max(16, 4 * capacity))

    def _alloc(self, slots: int) -> None:
        bits = max(4, (slots - 1).bit_length())
        self._keys = np.zeros(1 << bits, dtype=np.uint64)
        self._vals = np.zeros(1 << bits, dtype=np.int64)
        self._shift, self._mask = np.uint64(64 - bits), (1 << bits) - 1
        self._live = 0

    def _room(self, more: int) -> None:
        """Grow (to a quarter full) before `more` inserts would fill over half the slots."""
        if 2 * (self._live + more) <= len(self._keys):
            return
        live = self._keys != 0
        k, v = self._keys[live], self._vals[live]
        self._alloc(4 * (self._live + more))
        put = (_L or _loops()).setdefault_many
        self._live = put(self._keys, self._vals, k, v, self._shift, self._mask, np.empty_like(v))[0]

    # -- batch calls (uint64 keys) ---------------------------------------------------------------
    def setdefault_many(self, ks: np.ndarray, vs: np.ndarray) -> np.ndarray:
        """dict.setdefault for each pair in order: the values the keys map to afterwards (int64)."""
        self._room(len(ks))
        out = np.empty(len(ks), dtype=np.int64)
        put = (_L or _loops()).setdefault_many
        new, marks = put(self._keys, self._vals, ks, vs, self._shift, self._mask, out)
        self._live += new
        if marks:  # key 0 (the empty mark) goes to the side dict, in order
            for i in np.flatnonzero(ks == 0).tolist():
                out[i] = self._side.setdefault(int(ks[i]), int(vs[i]))
        return out

    def assign_many(self, ks: np.ndarray, vs: np.ndarray) -> None:
        """`self[k] = v` for each pair, in place (no entry moves); KeyError if a key was absent (the
        present ones are assigned)."""
        n = (_L or _loops()).assign_many(self._keys, self._vals, ks, vs, self._shift, self._mask)
        if n < len(ks):  # key 0 (skipped by the loop) lives in the side dict
            for i in np.flatnonzero(ks == 0).tolist():
                if 0 in self._side:
                    self._side[0] = int(vs[i])
                    n += 1
        if n < len(ks):
            raise KeyError("assign_many: a key is not in the map")

    def delete_many(self, ks: np.ndarray) -> int:
        """Delete present keys (absent ones are ignored); how many were present."""
        n = (_L or _loops()).delete_many(self._keys, self._vals, ks, self._shift, self._mask)
        self._live -= n
        if self._side and (ks == 0).any():
            n += self._side.pop(0, None) is not None
        return n

    def slots(self) -> tuple[np.ndarray, np.ndarray, np.uint64, int]:
        """(keys, vals, shift, mask): the table, for a compiled loop that probes, inserts and deletes
        in place (`u64map_loops.find`, `_free`; room made first with `reserve`), reporting its count
        through `live_changed`. Key 0, the empty-slot mark, is not in it (`__setitem__` keeps it)."""
        return self._keys, self._vals, self._shift, self._mask

    def reserve(self, more: int) -> None:
        """Room for `more` inserts into `slots()` (the table may be rebuilt: read it after)."""
        self._room(more)

    def live_changed(self, delta: int) -> None:
        """A compiled loop inserted (delta > 0) or deleted keys in `slots()`."""
        self._live += delta

    def run(self, ks: np.ndarray) -> np.ndarray:
        """The values of the leading run of `ks` present in the map (stops at the first absent key)."""
        out = np.empty(len(ks), dtype=np.int64)
        n = (_L or _loops()).run(self._keys, self._vals, ks, self._shift, self._mask, out)
        if n < 0:  # key 0 at -1 - n: the side dict answers, the run goes on after it
            i = -1 - n
            v = self._side.get(int(ks[i]))
            if v is None:
                return out[:i]
            out[i] = v
            rest = self.run(ks[i + 1 :])
            out[i + 1 : i + 1 + len(rest)] = rest
            return out[: i + 1 + len(rest)]
        return out[:n]

    def hinted_run(
        self, ks: np.ndarray, limit: int, hint: np.ndarray, has: np.ndarray, bh: np.ndarray
    ) -> np.ndarray:
        """`run(ks[:limit])`, the leading blocks taken from `hint` while each still holds its key (a
        pool's uint64 mirror: `has[b]` and `bh[b] == key`), the map asked from the first that does
        not: one compiled pass where a bulk check and a run took several numpy ones."""
        m = min(len(hint), limit)
        out = np.empty(limit, dtype=np.int64)
        n = (_L or _loops()).hinted_run(
            self._keys, self._vals, ks, limit, hint, m, has, bh, self._shift, self._mask, out
        )
        if n < 0:  # key 0 at -1 - n, past the hint's run: the map's run goes on from there
            i = -1 - n
            rest = self.run(ks[i:limit])
            out[i : i + len(rest)] = rest
            n = i + len(rest)
        return out[:n]

    # -- the dict API (one key at a time, from Python) ---------------------------------------------
    def _slot(self, key: int) -> int:
        """The slot holding `key` (1 <= key < 2**64), or -1: `u64map_loops.find`'s probe written in
        Python, as one key from Python costs 0.74 us this way and 1.31 us through numba's dispatch."""
        keys, mask = self._keys, self._mask
        j = ((key * _MUL) & _M64) >> int(self._shift)
        while (k := int(keys[j])) != 0:
            if k == key:
                return j
            j = (j + 1) & mask
        return -1

    @staticmethod
    def _is_key(key: object) -> bool:
        return isinstance(key, int | np.integer) and 0 <= key <= _M64

    def get(self, key, default=None):
        if not self._is_key(key):
            return default
        key = int(key)
        if key == 0:
            return self._side.get(key, default)
        j = self._slot(key)
        return default if j < 0 else int(self._vals[j])

    def __getitem__(self, key) -> int:
        v = self.get(key)
        if v is None:
            raise KeyError(key)
        return v

    def __contains__(self, key) -> bool:
        return self.get(key) is not None

    def __setitem__(self, key, value) -> None:
        if not self._is_key(key):
            raise KeyError(f"{key!r}: U64Map keys are ints in [0, 2**64)")
        key = int(key)
        if key == 0:
            self._side[key] = int(value)
            return
        j = self._slot(key)
        if j >= 0:
            self._vals[j] = value
        else:
            self.setdefault_many(np.array([key], dtype=np.uint64), np.array([int(value)], dtype=np.int64))

    def __delitem__(self, key) -> None:
        if self._is_key(key) and key == 0:
            del self._side[0]
            return
        if not self._is_key(key) or not self.delete_many(np.array([int(key)], dtype=np.uint64)):
            raise KeyError(key)

    def __len__(self) -> int:
        return self._live + len(self._side)

    def __iter__(self) -> Iterator[int]:
        yield from self._side
        yield from self._keys[self._keys != 0].tolist()

    def items(self):
        live = self._keys != 0
        return [*self._side.items(), *zip(self._keys[live].tolist(), self._vals[live].tolist(), strict=True)]

    def values(self):
        return [*self._side.values(), *self._vals[self._keys != 0].tolist()]

    def clear(self) -> None:
        self._side.clear()
        self._alloc(len(self._keys))
