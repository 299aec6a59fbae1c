"""`cache analyze --ray`'s shared accesses packed into arrays: a pickled copy unpacks to the very
requests `block_accesses` made (keys, order, fields) and replays to the same cell; the pickle is
buffers, far smaller than the lists of ints it replaces."""

from __future__ import annotations

import pickle

from agentkv.cache.analyze import run_cell
from agentkv.cache.grid import make_grid
from agentkv.cache.packed import PackedRequests, common_prefix
from agentkv.trace.accesses import BlockRequest, arrivals, block_accesses
from agentkv.trace.formats import bundled_sample, load_paths

BIG = 2**64 - 1  # keys are uint64: the top bit set must survive


def _req(session: str, hashes: list[int], last: bool = False, stop: str = "end_turn") -> BlockRequest:
    return BlockRequest(1.5, 2.25, session, hashes, 16 * len(hashes) + 3, 7, stop, last)


def _copy(packed: PackedRequests) -> PackedRequests:
    return pickle.loads(pickle.dumps(packed, protocol=5))


def test_common_prefix_finds_the_first_difference_anywhere():
    a = list(range(1000))
    for k in (0, 1, 499, 500, 998, 999):
        b = a[:k] + [-1] + a[k + 1 :]
        assert common_prefix(a, b) == k and common_prefix(b, a) == k
    assert common_prefix(a, a[:10]) == 10 and common_prefix([], a) == 0 and common_prefix(a, a) == 1000


def test_shared_prefixes_new_keys_and_empty_requests_round_trip():
    sys_prompt = [BIG, BIG - 1, 2**63]
    reqs = [
        _req("t:a", sys_prompt + [1, 2]),
        _req("t:b", sys_prompt + [9], stop="tool_use"),  # another session, same first key
        _req("t:a", sys_prompt + [1, 2, 3, 4]),  # its session's previous request, extended
        _req("t:a", sys_prompt + [1, 5], last=True),  # diverges mid-list (context edited)
        _req("t:c", [], last=True),  # a prompt shorter than one block
        _req("t:b", [7, 8], last=True),  # nothing shared
    ]
    packed = PackedRequests.pack(reqs)
    assert packed.base.tolist() == [-1, 0, 0, 2, -1, -1]
    assert packed.common.tolist() == [0, 3, 5, 4, 0, 0]
    assert packed.keys.tolist() == sys_prompt + [1, 2, 9, 3, 4, 5, 7, 8]
    back = _copy(packed).requests()
    assert back == reqs
    assert [type(x) for x in (back[0].time, back[0].input_tokens, back[0].hashes[0])] == [float, int, int]


def test_a_copy_unpacks_once_and_pickles_without_its_lists():
    packed = PackedRequests.pack([_req("t:a", [1, 2]), _req("t:a", [1, 2, 3], last=True)])
    copy = _copy(packed)
    first = copy.requests()
    assert copy.requests() is first  # a Ray worker unpacks once per block size, not once a cell
    assert _copy(copy).__dict__.keys() == packed.__dict__.keys()
    assert _copy(copy)._unpacked is None


def test_the_bundled_traces_unpack_equal_smaller_and_replay_the_same():
    arrived = arrivals(load_paths(bundled_sample()))
    reqs = block_accesses(arrived, 16)
    packed = PackedRequests.pack(reqs)
    back = _copy(packed).requests()
    assert back == reqs
    assert len(packed.keys) < sum(len(r.hashes) for r in reqs) / 5  # sessions' keys stored once
    assert len(pickle.dumps(packed, protocol=5)) < len(pickle.dumps(reqs, protocol=5)) / 5
    grid = make_grid("8GB", "16", "lru")
    want, got = (run_cell(grid, r, 16, grid.capacities[0], "lru") for r in (reqs, back))
    want.seconds = got.seconds = 0.0
    assert got == want and want.hit_tokens > 0
