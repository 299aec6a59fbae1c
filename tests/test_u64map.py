"""`U64Map`, the pool's hash -> block map: every call answers as a dict would, batch or single, with
the empty-slot mark (hash 0), deletes and growth; `BlockPool` falls back to a dict for other hashes."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.kv.hashmap import add_copies, drop_copies
from agentkv.kv.interface import PoolRequest
from agentkv.kv.pool import BlockPool
from agentkv.kv.u64map import U64Map, as_keys

KEYS = st.one_of(st.sampled_from([0, 1, 2, 3, 2**64 - 1]), st.integers(0, 2**64 - 1))
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.lists(st.tuples(KEYS, st.integers(0, 999)), max_size=12)),
        st.tuples(st.just("del"), st.integers(0, 30)),
        st.tuples(st.just("set"), KEYS, st.integers(0, 9)),
        st.tuples(st.just("pop"), st.integers(0, 30)),
        st.tuples(st.just("run"), st.integers(0, 30), KEYS),
        st.tuples(st.just("assign"), st.integers(0, 30), st.integers(0, 999)),
    ),
    max_size=60,
)


def _u64(xs: list[int]) -> np.ndarray:
    return np.array(xs, dtype=np.uint64)


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_every_call_answers_as_a_dict(ops):
    """Random batches of setdefault, deletes, in-place assigns, single sets and leading-run lookups on a
    small map (so it rebuilds and grows): the same values, lengths, items and runs as a dict given the
    same calls."""
    m, d = U64Map(4), {}
    for op in ops:
        if op[0] == "put":
            ks, vs = [k for k, _ in op[1]], [v for _, v in op[1]]
            got = m.setdefault_many(_u64(ks), np.array(vs, dtype=np.int64)).tolist()
            assert got == [d.setdefault(k, v) for k, v in zip(ks, vs, strict=True)]
        elif op[0] == "del":
            gone = list(d)[: op[1]]
            m.delete_many(_u64(gone))
            for k in gone:
                del d[k]
        elif op[0] == "set":
            m[op[1]] = d[op[1]] = op[2]
        elif op[0] == "assign":  # present keys only, in place
            ks = list(d)[: op[1]]
            m.assign_many(_u64(ks), np.arange(op[2], op[2] + len(ks), dtype=np.int64))
            d.update(zip(ks, range(op[2], op[2] + len(ks)), strict=True))
        elif op[0] == "pop":
            if d:
                k = list(d)[op[1] % len(d)]
                del m[k], d[k]
        else:
            ks = [*list(d)[: op[1]], op[2]]
            want = []
            for k in ks:
                if k not in d:
                    break
                want.append(d[k])
            assert m.run(_u64(ks)).tolist() == want
        assert len(m) == len(d)
    assert dict(m.items()) == d and sorted(m) == sorted(d) and sorted(m.values()) == sorted(d.values())
    for k in [*d, 5, 2**63]:
        assert m.get(k) == d.get(k) and (k in m) == (k in d)


def _homed(slot: int, n: int, bits: int = 4) -> list[int]:
    """`n` keys whose probe starts at `slot` of a 2**bits-slot table (the top bits of key x MUL)."""
    out, k = [], 2
    while len(out) < n:
        if ((k * 0x9E3779B97F4A7C15) % 2**64) >> (64 - bits) == slot:
            out.append(k)
        k += 1
    return out


@pytest.mark.parametrize("order", [[0, 1, 2, 3, 4, 5], [5, 4, 3, 2, 1, 0], [2, 0, 4, 1, 5, 3]])
def test_deletes_keep_every_other_key_reachable_across_the_tables_end(order):
    """Keys homed on the last two slots of a 16-slot table run past its end; deleting them in any
    order (each delete moves later entries back, no deleted marks) leaves the rest found, and the
    table holds no slot that no key claims."""
    m = U64Map(4)
    keys = _homed(15, 3) + _homed(14, 2) + _homed(0, 1)
    m.setdefault_many(_u64(keys), np.arange(len(keys), dtype=np.int64))
    assert len(m._keys) == 16
    left = dict(zip(keys, range(len(keys)), strict=True))
    for i in order:
        del m[keys[i]]
        del left[keys[i]]
        assert dict(m.items()) == left and all(m.get(k) == v for k, v in left.items())
        assert np.count_nonzero(m._keys) == len(left)


def test_single_key_calls_and_refusals():
    """The dict API on one key: [] and del raise KeyError for absent keys, as an in-place assign does;
    keys outside [0, 2**64) are never present and cannot be set; clear empties it; a pickled map is the
    same map."""
    m = U64Map()
    m[0], m[7], m[2**64 - 1] = 10, 70, 99
    assert m[0] == 10 and m[7] == 70 and m.get(2**64 - 1) == 99 and len(m) == 3
    assert m.get(-1) is None and m.get(2**64) is None and "x" not in m and 8 not in m
    with pytest.raises(KeyError):
        m[8]
    with pytest.raises(KeyError):
        del m[8]
    with pytest.raises(KeyError):
        m[-3] = 1
    del m[7]
    assert 7 not in m and len(m) == 2
    with pytest.raises(KeyError):  # in-place assigns are for present keys only (0 too)
        m.assign_many(_u64([2**64 - 1, 7]), np.array([1, 2], dtype=np.int64))
    assert m[2**64 - 1] == 1 and 7 not in m  # (the present one assigned)
    m[2**64 - 1] = 99
    del m[0]
    with pytest.raises(KeyError):
        m.assign_many(_u64([0]), np.array([5], dtype=np.int64))
    m[0] = 10
    assert dict(pickle.loads(pickle.dumps(m)).items()) == {0: 10, 2**64 - 1: 99}
    m.clear()
    assert len(m) == 0 and list(m) == []


@given(st.lists(st.integers(-(2**63), 2**64 - 1), max_size=20))
def test_as_keys_answers_alike_for_a_list_and_an_integer_array(ids):
    """A list and an integer array of the same hashes give the same keys, or both None when one is
    negative (numpy's conversion of an int64 array would wrap it to a large key: the same hash then
    reads as another in the map and in a dict); a 64-bit array is not copied."""
    want = None if any(i < 0 for i in ids) else list(ids)
    got = as_keys(ids)
    assert (None if got is None else got.tolist()) == want
    signed = all(i < 2**63 for i in ids)
    if not signed and want is None:
        return  # (in no integer dtype)
    arr = np.array(ids, dtype=np.int64 if signed else np.uint64)
    got = as_keys(arr)
    assert (None if got is None else got.tolist()) == want
    if got is not None and len(arr):
        assert np.shares_memory(got, arr)
    if signed and all(-(2**31) <= i < 2**31 for i in ids):
        got = as_keys(arr.astype(np.int32))
        assert (None if got is None else got.tolist()) == want


def _req(rid: str, hashes: list[int]) -> PoolRequest:
    return PoolRequest(request_id=rid, block_hashes=hashes)


def test_pool_keeps_a_u64map_and_falls_back_to_a_dict_for_other_hashes():
    """A pool's map is a U64Map while every hash is a uint64 (0 and 1 included); the first hash
    outside uint64 turns it into a dict holding the same entries, and lookups answer the same."""
    pool = BlockPool(32, block_size=4)
    a = _req("a", [0, 1, 2**64 - 1, 5])
    assert pool.allocate_slots(a, 16)
    assert type(pool.cached) is U64Map and pool.get_computed_blocks([0, 1, 2**64 - 1, 5]).num_blocks == 4
    pool.free("a")
    b = _req("b", [0, 1, -7, 2**70])
    assert pool.allocate_slots(b, 16, 8, pool.get_computed_blocks(b.block_hashes, 17))
    assert type(pool.cached) is dict and not pool._mirror
    assert pool.get_computed_blocks([0, 1, 2**64 - 1, 5]).num_blocks == 4
    assert pool.get_computed_blocks([0, 1, -7, 2**70]).num_blocks == 4
    pool.check_invariants()


def _drop_one_at_a_time(cached, dups, has, named, blocks, hashes) -> list[int]:
    """The reference: vLLM's eviction of each block in turn, on a dict (a copy promoted at once)."""
    gone = []
    for b, h in zip(blocks, hashes, strict=True):
        others = dups.get(h)
        if others is None:
            del cached[h]
            gone.append(h)
            continue
        if cached[h] == b:
            cached[h] = nxt = others.pop(0)
            has[nxt], named[nxt] = True, h
        else:
            others.remove(b)
        if not others:
            del dups[h]
    return gone


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("cache"), st.lists(st.sampled_from([0, 1, 5, 9, 2**64 - 1]), max_size=6)),
            st.tuples(st.just("evict"), st.lists(st.integers(0, 40), max_size=8)),
        ),
        max_size=40,
    )
)
def test_evicting_copies_answers_as_one_block_at_a_time(ops):
    """`drop_copies` on a `U64Map` (the map read and written in bulk) and on a dict leave the same
    map, copies, returned hashes and marks as evicting one block at a time: hashes cached several
    times over (0 and 2**64 - 1 among them), victims in any order, a copy promoted and evicted in one
    batch."""
    maps = [U64Map(4), {}, {}]  # bulk on a U64Map, bulk on a dict, the reference
    dups: list[dict[int, list[int]]] = [{}, {}, {}]
    has = [np.zeros(300, bool) for _ in maps]
    named = [np.zeros(300, np.uint64) for _ in maps]
    held: dict[int, int] = {}  # block -> its hash
    nxt = 0
    for op, arg in ops:
        if op == "cache":
            blocks = list(range(nxt, nxt + len(arg)))
            nxt += len(arg)
            got = maps[0].setdefault_many(np.array(arg, np.uint64), np.array(blocks, np.int64)).tolist()
            for m in maps[1:]:
                assert got == [m.setdefault(h, b) for h, b in zip(arg, blocks, strict=True)]
            for dd in dups:
                add_copies(dd, list(arg), blocks, got)
            held.update(zip(blocks, arg, strict=True))
            continue
        live = sorted(held)
        victims = list(dict.fromkeys(live[i % len(live)] for i in arg)) if live else []
        hashes = [held.pop(b) for b in victims]
        vb = np.array(victims, np.int64)
        gone = [
            drop_copies(maps[0], dups[0], has[0], vb, list(hashes), np.array(hashes, np.uint64), named[0]),
            drop_copies(maps[1], dups[1], has[1], vb, list(hashes), None, named[1]),
            _drop_one_at_a_time(maps[2], dups[2], has[2], named[2], victims, hashes),
        ]
        assert gone[0] == gone[1] == gone[2]
        assert dict(maps[0].items()) == maps[1] == maps[2] and dups[0] == dups[1] == dups[2]
        assert list(maps[1]) == list(maps[2])  # a dict's order too (keys set in place)
        for arr in (has, named):
            assert (arr[0] == arr[2]).all() and (arr[1] == arr[2]).all()
    assert set(held) == set(maps[2].values()) | {b for bs in dups[2].values() for b in bs}


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(st.sampled_from([0, 1, 2, 3, 4, 5, 2**64 - 1]), st.integers(0, 15), max_size=7),
    st.lists(st.sampled_from([0, 1, 2, 3, 4, 5, 6, 2**64 - 1]), max_size=10),
    st.lists(st.one_of(st.integers(0, 15), st.sampled_from([-1, 16, 99])), max_size=12),
    st.lists(
        st.tuples(st.booleans(), st.sampled_from([0, 1, 2, 3, 4, 5, 2**64 - 1])), min_size=16, max_size=16
    ),
    st.integers(0, 12),
)
def test_a_hinted_run_answers_as_the_hint_checked_then_the_map(entries, keys, hint, mirror, limit):
    """`hinted_run`: the hint's blocks while each still holds its key in the mirror (`has`, `bh`; a
    block id out of range holds nothing), then the map's run from the first that does not (key 0
    too, from the side dict): the answer the bulk check and `run` gave, written out here one key at
    a time."""
    m = U64Map(2)
    for k, v in entries.items():
        m[k] = v
    limit = min(limit, len(keys))
    has = np.array([h for h, _ in mirror], dtype=bool)
    bh = np.array([k for _, k in mirror], dtype=np.uint64)
    want, i = [], 0
    while i < min(len(hint), limit) and 0 <= hint[i] < 16 and has[hint[i]] and int(bh[hint[i]]) == keys[i]:
        want.append(hint[i])
        i += 1
    while i < limit and keys[i] in entries:
        want.append(entries[keys[i]])
        i += 1
    got = m.hinted_run(_u64(keys), limit, np.array(hint, dtype=np.int64), has, bh)
    assert got.tolist() == want
