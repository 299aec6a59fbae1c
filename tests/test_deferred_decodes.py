"""The pools' answers the engine's deferred decodes rest on: how many decode steps an allocation is a
no-op for (`quiet_decodes`), and whether growths surely fit (`surely_fits`), on constructed cases."""

from __future__ import annotations

import copy
import random

import pytest

from agentkv.kv.groups import GroupSpec, HybridPool
from agentkv.kv.interface import PoolRequest
from agentkv.kv.pool import BlockPool


def _state(pool, rid):
    """What an allocation can change: the counters and the request's tables."""
    if isinstance(pool, BlockPool):
        return (
            copy.copy(pool.stats),
            len(pool._req_blocks[rid]),
            pool._req_hashed[rid],
            pool.num_free_blocks,
        )
    tables = [len(t) for t in pool.tables[rid]] + [int((t >= 0).sum()) for t in pool.tables[rid]]
    return (copy.copy(pool.stats), tables, list(pool.hashed[rid]), list(pool.skip[rid]), pool.available_bytes)


def _pools():
    yield BlockPool(200, block_size=4)
    yield HybridPool([GroupSpec("full", 2), GroupSpec("sliding", 3, window=10)], 2000, 4)
    yield HybridPool([GroupSpec("full", 2), GroupSpec("chunked", 3, window=8)], 2000, 4)
    yield HybridPool([GroupSpec("full", 2), GroupSpec("sliding", 3, window=3)], 2000, 4)


@pytest.mark.parametrize("pool", list(_pools()), ids=["dense", "sliding", "chunked", "short-window"])
@pytest.mark.parametrize("prompt", [17, 20, 21, 23])
def test_quiet_decodes_counts_the_no_op_allocations_exactly(pool, prompt):
    """After a prompt's prefill, `quiet_decodes` says how many one-token decode allocations change
    nothing; the next one changes something (a block taken, filled and cached, or freed)."""
    rng = random.Random(prompt)
    hashes = [
        rng.getrandbits(60) for _ in range(prompt // 4 + 3)
    ]  # hashes past the prompt: decode blocks fill
    req = PoolRequest(f"r{prompt}", hashes, prompt_len=prompt)
    assert pool.allocate_slots(req, prompt)
    nc, checked = prompt, 0
    while nc < prompt + 24:
        k = pool.quiet_decodes(req, nc)
        for j in range(k):
            before = _state(pool, req.request_id)
            assert pool.allocate_slots(req, 1, nc + j)
            assert _state(pool, req.request_id) == before, (nc, j, k)
        nc += k
        before = _state(pool, req.request_id)
        assert pool.allocate_slots(req, 1, nc)
        assert _state(pool, req.request_id) != before, (nc, k)
        nc += 1
        checked += k + 1
    assert checked >= 24
    pool.free(req.request_id)


def test_surely_fits_is_never_a_false_yes():
    """Two requests growing in turn: `surely_fits` answers yes only when both allocations succeed
    (tried on copies of the pool), and it does answer yes and no here."""
    answers = set()
    for total in range(40, 400, 7):
        pool = HybridPool([GroupSpec("full", 2), GroupSpec("sliding", 3, window=10)], 600, 4)
        a, b = PoolRequest("a", [], prompt_len=40), PoolRequest("b", [], prompt_len=40)
        assert pool.allocate_slots(a, 40) and pool.allocate_slots(b, 40)
        grows = [(a, total), (b, 40 + total // 2)]
        yes = pool.surely_fits(grows)
        answers.add(yes)
        if yes:
            trial = copy.deepcopy(pool)
            ra, rb = [r for r, _ in grows]
            assert trial.allocate_slots(ra, total - 40, 40) and trial.allocate_slots(rb, total // 2, 40)
    dense = BlockPool(30, block_size=4)
    a = PoolRequest("a", [])
    assert dense.allocate_slots(a, 40)  # 10 blocks of 30
    assert dense.surely_fits([(a, 120)]) and not dense.surely_fits([(a, 121)])
    assert answers == {True, False}


def _engine(defer: bool):
    from agentkv.engine.config import EngineConfig
    from agentkv.engine.engine import Engine

    eng = Engine(EngineConfig(max_num_batched_tokens=256, num_gpu_blocks_override=4000), itl_sink=[])
    eng.defer_decodes = defer
    rng = random.Random(1)
    for i in range(6):  # short prompts that decode long
        eng.add_request(
            f"d{i}", prompt_len=40 + i, max_tokens=300, block_hashes=[rng.getrandbits(60) for _ in range(10)]
        )
    return eng


def _view(eng):
    reqs = sorted(eng.requests.values(), key=lambda r: r.request_id)
    return [
        (r.request_id, r.num_computed, r.num_output, r.last_token, r.itl_max, r.first_token) for r in reqs
    ]


def test_engine_steps_with_deferred_decodes_equal_plain_steps_through_an_abort():
    """Two engines fed alike, one deferring quiet decodes beside a long prefill: every step's end,
    and after an abort mid-prefill (which applies the deferred updates first) every request's
    counters and times, equal the plain engine's; the deferral did run."""
    plain, fast = _engine(False), _engine(True)
    for _ in range(8):  # the short ones start decoding
        assert plain.step().end == fast.step().end
        plain.clock.advance_to(plain.requests["d0"].last_token)
        fast.clock.advance_to(fast.requests["d0"].last_token)
    for eng in (plain, fast):
        eng.add_request("long", prompt_len=6000, max_tokens=5, block_hashes=list(range(1, 376)))
    for n in range(40):
        if n == 12:
            assert plain.abort("d3") and fast.abort("d3")
            assert _view(plain) == _view(fast)
        a, b = plain.step(), fast.step()
        assert (a.start, a.end, a.num_prefill_tokens, a.num_decode) == (
            b.start,
            b.end,
            b.num_prefill_tokens,
            b.num_decode,
        )
        plain.clock.advance_to(a.end)
        fast.clock.advance_to(b.end)
    fast.sync()
    assert _view(plain) == _view(fast) and sorted(plain.itl_sink) == sorted(fast.itl_sink)
    assert fast.deferred_steps > 10 and plain.deferred_steps == 0
