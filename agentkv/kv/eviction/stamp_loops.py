"""The pools' per-block loops, compiled (numba), where a step's many small numpy calls cost more
than the blocks they touch: victim pops from the stamped queues (the dense pool's LRU by count, the
hybrid pool's by bytes), each reading a chunk only as far as its last victim, and the LRU's look
ahead (how many victims come before a block a waiting request needs); the hybrid pool's takes
(ids off the freed stack, then never-taken ones, marked: `take_ids`), frees (dropping references; a
window's passed blocks cut from the table and freed in the same pass), group 0's caching and chains
of copies of a hash (`cache_run`, `chain_add`, `chain_drop`, writing the `U64Map`'s table in place),
its evictions when nobody listens (`evict_first`) and its hinted prefix lookup (`hinted_prefix`);
and the dense pool's frees, admission checks and pins (a long context's table, thousands of blocks,
in one pass instead of several numpy gathers and masks). Reached through
`eviction.base.stamp_loops()`, which loads them when a pool is made (the hybrid pool's own through
`warm_hybrid_loops()`, when a hybrid pool is made)."""

from __future__ import annotations

import numba

from agentkv.kv.u64map_loops import _free, _run_from, at, drop, find, put


@numba.njit(cache=True, nogil=True)
def take_live(bl, st, stamp, ref, need, out):
    """Copy the first `need` live entries of the chunk (bl, st) into out (live: the entry's stamp is
    its block's latest and the block is unused); (how many it copied, how many entries it read)."""
    n = 0
    for i in range(len(bl)):
        b = at(bl[i])
        if stamp[b] == st[i] and ref[b] == 0:
            out[at(n)] = b
            n += 1
            if n == need:
                return n, i + 1
    return n, len(bl)


@numba.njit(cache=True, nogil=True)
def min_stamp(blocks, stamp):
    """The oldest (least) stamp of `blocks` (free ones: stamped); the int64 maximum for none."""
    m = 9223372036854775807
    for i in range(len(blocks)):
        s = stamp[at(blocks[i])]
        if s < m:
            m = s
    return m


@numba.njit(cache=True, nogil=True)
def live_before(bl, st, stamp, ref, bound, need):
    """How many live entries of the chunk (bl, st) come before the first stamped `bound` or later,
    up to `need`; and whether the count stops in this chunk (a stamped queue's stamps ascend)."""
    n = 0
    for i in range(len(bl)):
        if st[i] >= bound:
            return n, True
        b = at(bl[i])
        if stamp[b] == st[i] and ref[b] == 0:
            n += 1
            if n == need:
                return n, True
    return n, False


@numba.njit(cache=True, nogil=True)
def take_bytes(bl, st, stamp, cost, need, out):
    """Copy the chunk's oldest live entries (stamp still the block's latest) into out until their
    bytes (`cost`) reach `need` or out is full, zeroing their stamps; (how many, entries read, their
    bytes)."""
    n = 0
    freed = 0
    for i in range(len(bl)):
        b = at(bl[i])
        if stamp[b] == st[i]:
            stamp[b] = 0
            out[at(n)] = b
            n += 1
            freed += cost[b]
            if freed >= need or n == len(out):
                return n, i + 1, freed
    return n, len(bl), freed


@numba.njit(cache=True, nogil=True)
def mark_taken(arr, counts, costs, ref, hashed, group, cost):
    """Blocks arr, taken for each group g in turn (counts[g] of them): one reference, no hash, the
    group and its block bytes (costs[g])."""
    i = 0
    for g in range(len(counts)):
        for _ in range(counts[g]):
            b = at(arr[i])
            ref[b] = 1
            hashed[b] = False
            group[b] = g
            cost[b] = costs[g]
            i += 1


@numba.njit(cache=True, nogil=True)
def take_ids(ids, n_ids, fresh, counts, costs, ref, hashed, group, cost, out):
    """Fill out with block ids off the freed stack ids[:n_ids] (top first), then never-taken ones
    from `fresh` on (ascending; the arrays hold them), each marked taken for groups in turn
    (`mark_taken`); (the stack's new height, the next never-taken id)."""
    i = 0
    while i < len(out) and n_ids > 0:
        n_ids -= 1
        out[at(i)] = ids[at(n_ids)]
        i += 1
    while i < len(out):
        out[at(i)] = fresh
        fresh += 1
        i += 1
    mark_taken(out, counts, costs, ref, hashed, group, cost)
    return n_ids, fresh


@numba.njit(cache=True, nogil=True)
def _unref(b, ref, hashed, cost, cached, nc, empty, ne):
    """Drop one reference to block b: at zero it goes to cached[nc] (holding a hash) or empty[ne];
    (the new nc and ne, its bytes by cost gone to each)."""
    u = at(b)
    ref[u] -= 1
    if ref[u] == 0:
        if hashed[u]:
            cached[at(nc)] = b
            return nc + 1, ne, cost[u], 0
        empty[at(ne)] = b
        return nc, ne + 1, 0, cost[u]
    return nc, ne, 0, 0


@numba.njit(cache=True, nogil=True)
def unpin(arr, ref, hashed, cost, cached, empty):
    """Drop one reference to each block of arr (no block twice), in order: those reaching zero go to
    `cached` (holding a hash) or `empty`; (how many of each, and their bytes by `cost`)."""
    nc = ne = 0
    cb = eb = 0
    for i in range(len(arr)):
        nc, ne, c, e = _unref(arr[i], ref, hashed, cost, cached, nc, empty, ne)
        cb += c
        eb += e
    return nc, ne, cb, eb


@numba.njit(cache=True, nogil=True)
def cut_free(t, lo, hi, ref, hashed, cost, cached, nc, ids, n_ids):
    """Drop table t's blocks [lo, hi) right to left (nulls, -1, skipped) and null them (a window's
    blocks a request has passed): one whose last reference this was goes to cached[nc:] (holding a
    hash) or onto the free-id stack ids[n_ids:]; (the new nc and n_ids, the bytes of each by cost)."""
    cb = 0
    eb = 0
    for i in range(hi - 1, lo - 1, -1):
        b = t[at(i)]
        if b >= 0:
            t[at(i)] = -1
            nc, n_ids, c, e = _unref(b, ref, hashed, cost, cached, nc, ids, n_ids)
            cb += c
            eb += e
    return nc, n_ids, cb, eb


@numba.njit(cache=True, nogil=True)
def release(blocks, hashed, ref, cached, empty):
    """Drop one reference to each block of a table (no block twice), tail first: those reaching zero
    go to `cached` (the first `hashed` blocks, cached ones) or `empty` (the rest); (how many of each)."""
    nc = ne = 0
    for i in range(len(blocks) - 1, -1, -1):
        b = at(blocks[i])
        ref[b] -= 1
        if ref[b] == 0:
            if i < hashed:
                cached[at(nc)] = b
                nc += 1
            else:
                empty[at(ne)] = b
                ne += 1
    return nc, ne


@numba.njit(cache=True, nogil=True)
def unheld(blocks, ref, out):
    """Copy the blocks no request holds (ref 0) into out, in order; how many (an admission's cached
    hits that leave the free queue)."""
    n = 0
    for i in range(len(blocks)):
        b = at(blocks[i])
        if ref[b] == 0:
            out[at(n)] = b
            n += 1
    return n


@numba.njit(cache=True, nogil=True)
def pin(blocks, ref):
    """One more reference to each block (no block twice): an admission's shared hits, in one pass
    where `ref[blocks] += 1` gathers and scatters through numpy's fancy indexing."""
    for i in range(len(blocks)):
        ref[at(blocks[i])] += 1


@numba.njit(cache=True, nogil=True)
def _chain(b, p, cnext, cprev, ctail):
    """Block b, a younger copy of the hash whose oldest copy (the map's block) is p, to the tail of
    that hash's chain: cnext the next younger copy, cprev the next older, ctail a head's youngest."""
    t = ctail[at(p)]
    if t < 0:
        t = p
    cnext[at(t)] = b
    cprev[at(b)] = t
    cnext[at(b)] = -1
    ctail[at(p)] = b


@numba.njit(cache=True, nogil=True)
def chain_add(blocks, heads, cnext, cprev, ctail):
    """Each of blocks, a younger copy of the hash heads[i] holds (the map's block), to its chain
    (`_chain`)."""
    for i in range(len(blocks)):
        _chain(blocks[i], heads[i], cnext, cprev, ctail)


@numba.njit(cache=True, nogil=True)
def _unchain(b, k, cnext, cprev, ctail, named, mkeys, mvals, shift, mask):
    """Evict block b (hash k) from its chain and the map's table: 0, it was a younger copy; 1, the
    map's block, its hash handed to the next oldest copy (the second value; named[copy] = k); 2, no
    copy holds the hash any more (out of the table). Key 0 (kept aside by the map) is left to the
    caller."""
    p = cprev[b]
    if p >= 0:  # a younger copy: out of its chain
        nx = cnext[b]
        cnext[at(p)] = nx
        if nx >= 0:
            cprev[at(nx)] = p
        else:  # it was the youngest: its head's tail moves back
            head = p
            while cprev[at(head)] >= 0:
                head = cprev[at(head)]
            ctail[at(head)] = p if p != head else -1
        cprev[b] = -1
        cnext[b] = -1
        return 0, nx
    if ctail[b] >= 0:  # the map's block, with younger copies: the next oldest answers now
        nx = cnext[b]
        v = at(nx)
        cprev[v] = -1
        ctail[v] = ctail[b] if ctail[b] != nx else -1
        ctail[b] = -1
        cnext[b] = -1
        named[v] = k
        if k != 0:
            mvals[at(find(mkeys, k, shift, mask))] = nx
        return 1, nx
    if k != 0:  # no copy holds the hash any more
        _free(mkeys, mvals, find(mkeys, k, shift, mask), shift, mask)
    return 2, -1


@numba.njit(cache=True, nogil=True)
def chain_drop(victims, keys, cnext, cprev, ctail, named, mkeys, mvals, shift, mask, gone):
    """Evict victims (keys: their hashes) in order from their chains and from the map's table
    (`U64Map.slots`): a younger copy just leaves its chain; the map's block hands its hash to the
    next oldest copy (named[block] = key) or, with none, the hash leaves the map (into gone). (How
    many left; key 0's outcome, which the map keeps aside: -2 untouched, -1 gone, else its block.)"""
    nd = 0
    zero = -2
    for i in range(len(victims)):
        k = keys[i]
        how, nx = _unchain(at(victims[i]), k, cnext, cprev, ctail, named, mkeys, mvals, shift, mask)
        if how == 0:
            continue
        if k == 0:
            zero = nx
        if how == 2:
            gone[at(nd)] = k
            nd += 1
    return nd, zero


@numba.njit(cache=True, nogil=True)
def evict_first(
    victims, group, hashed, bkey, cnext, cprev, ctail, bh64, mkeys, mvals, shift, mask, ids, n_ids, rest
):
    """The hybrid pool's eviction when nobody listens (group 0's map a `U64Map`), in one pass: each
    victim unmarked; group 0's out of their chains and the map (`chain_drop`'s order), the other
    groups' copied to rest (in order: their dict maps are the caller's); then every victim unnamed
    (bh64) and pushed onto the free-id stack ids[n_ids:]. (How many hashes left group 0's map, key
    0's outcome as `chain_drop`'s, how many went to rest.)"""
    nd = 0
    zero = -2
    nr = 0
    for i in range(len(victims)):
        b = at(victims[i])
        hashed[b] = False
        if group[b] != 0:
            rest[at(nr)] = victims[i]
            nr += 1
            continue
        k = bkey[b]
        how, nx = _unchain(b, k, cnext, cprev, ctail, bh64, mkeys, mvals, shift, mask)
        if how == 0:
            continue
        if k == 0:
            zero = nx
        if how == 2:
            nd += 1
    for i in range(len(victims)):  # (after: a copy named above and evicted in this batch is unnamed)
        b = victims[i]
        bh64[at(b)] = 0
        ids[at(n_ids + i)] = b
    return nd, zero, nr


@numba.njit(cache=True, nogil=True)
def cache_run(seg, h64, mkeys, mvals, shift, mask, bkey, bh64, hashed, cnext, cprev, ctail, alias):
    """Cache group 0's blocks seg under hashes h64 in order: each marked hashed with its key, and
    inserted into the map's table (`U64Map.slots`, room reserved) unless its hash is there already,
    when it is a younger copy of the block the table gives (chained, aliased, unnamed in bh64). How
    many were inserted; -1, with nothing changed, if a hash is 0 (the map keeps that one aside)."""
    for i in range(len(h64)):
        if h64[i] == 0:
            return -1
    new = 0
    for i in range(len(seg)):
        b = seg[i]
        k = h64[i]
        u = at(b)
        bkey[u] = k
        hashed[u] = True
        p, added = put(mkeys, mvals, k, b, shift, mask)
        new += added
        if p == b:
            bh64[u] = k
            continue
        _chain(b, p, cnext, cprev, ctail)  # a copy: to the tail of its hash's chain
        alias[u] = p
        bh64[u] = 0  # the mirror names the block the map gives
    return new


@numba.njit(cache=True, nogil=True)
def hinted_prefix(hint, m, ks, limit, bh64, alias, mkeys, mvals, shift, mask, out):
    """Group 0's cached blocks of keys ks[:limit] into out, the map's answer: for i < m, hint[i]
    when its uint64 mirror holds the key (the mirror names only the block the map gives), else the
    copy it aliases when that one's does, else the map (`U64Map.slots`); past the hint, the map's
    run (`u64map_loops._run_from`). How many lead the run; -1 at a key 0 (the map keeps it aside:
    the caller asks the map)."""
    nb = len(bh64)
    for i in range(m):
        k = ks[at(i)]
        if k == 0:
            return -1
        b = hint[at(i)]
        if 0 <= b < nb:
            if bh64[at(b)] == k:
                out[at(i)] = b
                continue
            c = alias[at(b)]
            if c >= 0 and bh64[at(c)] == k:
                out[at(i)] = c
                continue
        j = find(mkeys, k, shift, mask)
        if j < 0:
            return i
        out[at(i)] = mvals[at(j)]
    n = _run_from(mkeys, mvals, ks, m, limit, shift, mask, out)
    return n if n >= 0 else -1


@numba.njit(cache=True, nogil=True)
def cache_marks(idx, keys, mkeys, mvals, shift, mask, got, bh, has, hashed):
    """The dense pool's caching of blocks idx under hashes keys in order: each inserted into the map's
    table (`U64Map.slots`, room reserved) unless its hash is there already, `got` the block the
    table gives; each marked hashed with its key, and named (`has`) where it is that block. (How
    many were inserted, how many are copies); (-1, 0), nothing changed, if a hash is 0 (the map
    keeps that one aside)."""
    for i in range(len(keys)):
        if keys[i] == 0:
            return -1, 0
    new = copies = 0
    for i in range(len(idx)):
        b = idx[i]
        k = keys[i]
        p, added = put(mkeys, mvals, k, b, shift, mask)
        new += added
        got[i] = p
        u = at(b)
        has[u] = p == b
        copies += p != b
        bh[u] = k
        hashed[u] = True
    return new, copies


@numba.njit(cache=True, nogil=True)
def uncache_marks(victims, bh, has, hashed, mkeys, mvals, shift, mask):
    """The dense pool's evicted blocks (none a copy of another) out of the map's table and unmarked;
    (how many keys left the table, whether a hash was 0: the map keeps that one aside)."""
    gone = 0
    zero = False
    for i in range(len(victims)):
        v = at(victims[i])
        k = bh[v]
        if k == 0:
            zero = True
        else:
            gone += drop(mkeys, mvals, k, shift, mask)
        has[v] = False
        hashed[v] = False
    return gone, zero
