"""`U64Map`'s compiled loops (numba), in their own module so that `agentkv.kv.u64map` imports numba
only when the first map is made. One probe (`find`) serves the batch loops and the map's one-key
calls; as module-level functions they load from numba's cache in each new process."""

from __future__ import annotations

import numba
import numpy as np

EMPTY, TOMB = np.uint64(0), np.uint64(1)  # slot marks: keys 0 and 1 live in the map's side dict
MUL = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: the top bits of key x MUL pick the slot


@numba.njit(cache=True, nogil=True)
def find(keys, k, shift, mask):
    """(the slot holding k or -1, the slot an insert of k takes: the first deleted one passed, else
    the empty one that ended the probe)."""
    j = np.int64((k * MUL) >> shift)
    t = -1
    while True:
        kk = keys[j]
        if kk == k:
            return j, j
        if kk == EMPTY:
            return -1, (j if t < 0 else t)
        if kk == TOMB and t < 0:
            t = j
        j = (j + 1) & mask


@numba.njit(cache=True, nogil=True)
def setdefault_many(keys, vals, ks, bs, shift, mask, out):
    """out[i]: the value ks[i] maps to after inserting (ks[i], bs[i]) unless present (-1 for the slot
    marks 0 and 1, left to the caller); (new keys, marks met)."""
    new = marks = 0
    for i in range(len(ks)):
        k = ks[i]
        if k <= TOMB:
            out[i] = -1
            marks += 1
            continue
        at, ins = find(keys, k, shift, mask)
        if at >= 0:
            out[i] = vals[at]
        else:
            keys[ins] = k
            vals[ins] = bs[i]
            out[i] = bs[i]
            new += 1
    return new, marks


@numba.njit(cache=True, nogil=True)
def delete_many(keys, ks, shift, mask):
    """Mark each present key's slot deleted (the slot marks 0 and 1 are skipped); how many were."""
    gone = 0
    for i in range(len(ks)):
        if ks[i] > TOMB:
            at = find(keys, ks[i], shift, mask)[0]
            if at >= 0:
                keys[at] = TOMB
                gone += 1
    return gone


@numba.njit(cache=True, nogil=True)
def run(keys, vals, ks, shift, mask, out):
    """Values of the leading keys of ks that are present, into out; how many (-1 - i when a slot
    mark 0 or 1 comes at i first: the caller looks that one up)."""
    for i in range(len(ks)):
        if ks[i] <= TOMB:
            return -1 - i
        at = find(keys, ks[i], shift, mask)[0]
        if at < 0:
            return i
        out[i] = vals[at]
    return len(ks)
