"""`U64Map`'s compiled loops (numba), in their own module so that `agentkv.kv.u64map` imports numba
only when the first map is made. One probe (`find`) serves the batch loops and the map's one-key
calls; as module-level functions they load from numba's cache in each new process.

Deletion shifts the entries after a freed slot back (linear probing's backward-shift delete), so the
table holds no deleted-slot marks: it never fills with them and is rebuilt only to grow."""

from __future__ import annotations

import numba
import numpy as np

EMPTY = np.uint64(0)  # the empty-slot mark: key 0 lives in the map's side dict
MUL = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: the top bits of key x MUL pick the slot
ONE = np.uint64(1)


@numba.njit(cache=True, nogil=True, inline="always")
def at(i):
    """Index `i` (known not negative) as uint64: numba then leaves out its negative-index wraparound
    (up to three fifths of a pool loop's instructions, measured)."""
    return np.uint64(i)


@numba.njit(cache=True, nogil=True)
def find(keys, k, shift, mask):
    """The slot holding k, or -1 - (the empty slot that ended the probe: where an insert of k goes)."""
    j = (k * MUL) >> shift
    m = np.uint64(mask)
    while True:
        kk = keys[j]
        if kk == k:
            return np.int64(j)
        if kk == EMPTY:
            return -1 - np.int64(j)
        j = (j + ONE) & m


@numba.njit(cache=True, nogil=True)
def put(keys, vals, k, v, shift, mask):
    """dict.setdefault(k, v) on the table (k not the empty mark, room made): the value k maps to
    afterwards, and whether it was inserted."""
    j = find(keys, k, shift, mask)
    if j >= 0:
        return vals[at(j)], False
    keys[at(-1 - j)] = k
    vals[at(-1 - j)] = v
    return v, True


@numba.njit(cache=True, nogil=True)
def setdefault_many(keys, vals, ks, bs, shift, mask, out):
    """out[i]: the value ks[i] maps to after inserting (ks[i], bs[i]) unless present (-1 for the
    empty mark 0, left to the caller); (new keys, marks met)."""
    new = marks = 0
    for i in range(len(ks)):
        k = ks[i]
        if k == EMPTY:
            out[i] = -1
            marks += 1
            continue
        out[i], added = put(keys, vals, k, bs[i], shift, mask)
        new += added
    return new, marks


@numba.njit(cache=True, nogil=True)
def _free(keys, vals, i, shift, mask):
    """Empty slot i, moving back each later entry of its run whose probe would no longer reach it."""
    i = at(i)
    j = i
    m = np.uint64(mask)
    while True:
        j = (j + ONE) & m
        kk = keys[j]
        if kk == EMPTY:
            break
        home = (kk * MUL) >> shift
        if (i < home <= j) if i <= j else (home > i or home <= j):
            continue  # its probe from home reaches j without passing i: it stays
        keys[i] = kk
        vals[i] = vals[j]
        i = j
    keys[i] = EMPTY


@numba.njit(cache=True, nogil=True)
def drop(keys, vals, k, shift, mask):
    """Delete k from the table if present (k not the empty mark); whether it was."""
    j = find(keys, k, shift, mask)
    if j < 0:
        return False
    _free(keys, vals, j, shift, mask)
    return True


@numba.njit(cache=True, nogil=True)
def delete_many(keys, vals, ks, shift, mask):
    """Delete each present key (the empty mark 0 is skipped); how many were."""
    gone = 0
    for i in range(len(ks)):
        if ks[i] != EMPTY:
            gone += drop(keys, vals, ks[i], shift, mask)
    return gone


@numba.njit(cache=True, nogil=True)
def _run_from(keys, vals, ks, i, n, shift, mask, out):
    """Values of ks[i:n] while present, into out[i:]; where the run ends (-1 - j when the empty mark
    0 comes at j first: the caller looks that one up)."""
    while i < n:
        if ks[i] == EMPTY:
            return -1 - i
        j = find(keys, ks[i], shift, mask)
        if j < 0:
            return i
        out[at(i)] = vals[at(j)]
        i += 1
    return n


@numba.njit(cache=True, nogil=True)
def run(keys, vals, ks, shift, mask, out):
    """Values of the leading keys of ks that are present, into out; how many (-1 - i when the empty
    mark 0 comes at i first: the caller looks that one up)."""
    return _run_from(keys, vals, ks, 0, len(ks), shift, mask, out)


@numba.njit(cache=True, nogil=True)
def assign_many(keys, vals, ks, vs, shift, mask):
    """vals of each present key of ks set to vs (in place: no entry moves; absent keys and the empty
    mark 0 are skipped); how many were present."""
    n = 0
    for i in range(len(ks)):
        if ks[i] != EMPTY:
            j = find(keys, ks[i], shift, mask)
            if j >= 0:
                vals[at(j)] = vs[i]
                n += 1
    return n


@numba.njit(cache=True, nogil=True)
def hinted_run(keys, vals, ks, limit, hint, m, has, bh, shift, mask, out):
    """`run` of ks[:limit] that takes hint[i] for key i while that block still holds it (`has` and
    `bh`, a pool's uint64 mirror; i < m) and asks the map from the first that does not; how many
    (-1 - i when the empty mark 0 comes at i in the map's part: the caller looks that one up)."""
    i, nb = 0, len(has)
    while i < m:
        b = hint[i]
        if b < 0 or b >= nb or not has[at(b)] or bh[at(b)] != ks[at(i)]:  # (an id out of range holds nothing)
            break
        out[at(i)] = b
        i += 1
    return _run_from(keys, vals, ks, i, limit, shift, mask, out)
