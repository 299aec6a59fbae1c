"""Decode bursts past a waiting queue the steps could not admit from (an overloaded engine): the
same requests, times and cache hits as stepping while anything waits, to the last bit, and the
LRU's look-ahead names the victims it will give."""

from __future__ import annotations

import numpy as np
import pytest

from agentkv.engine.config import EngineConfig
from agentkv.engine.engine import Engine
from agentkv.engine.scheduler import Scheduler
from agentkv.kv.eviction.base import Evictor
from agentkv.kv.eviction.lru import LRU
from agentkv.kv.pool import BlockPool


def replay(queued: bool, policy: str) -> tuple[list[tuple], int]:
    """Sessions whose turns extend each other on a pool too small for them all: the queue waits on
    blocks while others decode. Bursts run when nothing waits, and past a queue when `queued`.
    Returns each request's outcome and the bursts run with a queue."""
    cfg = EngineConfig(
        model="Llama-3.1-8B",
        num_gpu_blocks_override=260,
        max_model_len=8192,
        max_num_batched_tokens=512,
        eviction_policy=policy,
    )
    e = Engine(cfg)
    rng = np.random.default_rng(7)
    reqs, queued_bursts, t = [], 0, 0.0
    prompts = {s: [1000 * s + i for i in range(int(rng.integers(200, 900)))] for s in range(8)}
    for turn in range(3):
        for s, toks in prompts.items():
            out = int(rng.integers(20, 300))
            reqs.append(e.add_request(f"{s}-{turn}", max_tokens=out, token_ids=toks, session_id=s))
            prompts[s] = toks + [5_000_000 + 1000 * s + turn * 100 + i for i in range(out + 40)]
        while e.has_work():
            b = e.plan_burst() if queued or not e.scheduler.waiting else None
            if b is not None:
                queued_bursts += bool(e.scheduler.waiting)
                e.commit_burst(b, len(b.ends))
                t = b.ends[-1]
            else:
                res = e.step()
                assert res is not None, "the engine stalled"
                t = res.end
            e.clock.advance_to(t)
            e.pool.check_invariants()
    rows = [
        (r.request_id, r.first_token, r.finished_at, r.itl_max, r.num_cached_tokens, r.num_preemptions)
        for r in reqs
    ]
    return rows, queued_bursts


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_bursts_past_a_blocked_queue_match_steps_exactly(policy):
    stepped, _ = replay(False, policy)
    bursts, queued = replay(True, policy)
    assert bursts == stepped  # floats compared exactly: such a burst times each step as step() does
    assert queued > 0  # the queue did wait while bursts ran
    assert any(row[5] for row in stepped) or any(row[4] for row in stepped)  # hits or preemptions happened


def test_lru_look_ahead_names_the_victims_without_taking_them():
    pool = BlockPool(64, 16, "lru")
    lru = pool.policy
    assert isinstance(lru, LRU)
    lru.add_many(np.arange(10, 30, dtype=np.int64))
    lru.add_many(np.arange(0, 10, dtype=np.int64))
    pool.ref[[12, 3]] = 1  # re-used by a hit: no longer a victim
    lru.remove_many(np.array([12, 3], dtype=np.int64))
    ahead = lru.next_victims(25)
    assert len(lru) == 28 and lru.next_victims(25).tolist() == ahead.tolist()  # unchanged by looking
    assert ahead.tolist() == lru.pop_victims(25).tolist()
    assert lru.next_victims(10).tolist() == [7, 8, 9]  # fewer when fewer are left
    assert len(lru.next_victims(0)) == 0


def test_lru_room_before_a_waiting_block_counts_the_victims_that_go_first():
    """The LRU's compiled count equals the look-ahead's: the victims `pop_victims` gives before the
    first of the given free blocks, up to `n`, past stale entries (hit, freed again) and chunk ends."""
    rng = np.random.default_rng(3)
    for trial in range(60):
        pool = BlockPool(96, 16, "lru")
        lru, ref = pool.policy, pool.ref
        ref[:] = 1  # every block held; frees and hits below move them in and out of the queue
        for _ in range(int(rng.integers(1, 8))):
            held, free = np.flatnonzero(ref), np.flatnonzero(ref == 0)
            if len(free) and rng.random() < 0.3:  # a hit: free blocks held again, entries stale
                hit = rng.choice(free, size=int(rng.integers(1, len(free) + 1)), replace=False)
                ref[hit] = 1
                lru.remove_many(hit.astype(np.int64))
            elif len(held):  # a request's free: a chunk, tail first
                chunk = rng.choice(held, size=int(rng.integers(1, min(len(held), 30) + 1)), replace=False)
                ref[chunk] = 0
                lru.add_many(chunk.astype(np.int64))
        free = np.flatnonzero(ref == 0)
        waited = rng.choice(free, size=min(len(free), int(rng.integers(0, 4))), replace=False).astype(
            np.int64
        )
        for n in (0, 1, 5, 40, 200):
            order = lru.next_victims(n).tolist()
            first = [i for i, b in enumerate(order) if b in set(waited.tolist())]
            want = first[0] if first else len(order)
            assert lru.room_before(waited, n) == want, (trial, n)
            assert generic_room(lru, waited, n) == want  # the generic look-ahead agrees
        assert lru.room_before(np.zeros(0, np.int64), 10**6) == len(lru) == len(free)  # none waited for


def generic_room(lru: LRU, blocks: np.ndarray, n: int) -> int | None:
    """The generic `Evictor.room_before` (a mask over the peeked victims), on the same LRU."""
    return Evictor.room_before(lru, blocks, n)


def test_burst_room_stops_before_the_first_cached_block_the_queue_head_needs(monkeypatch):
    """Where a burst's room ends short of the victim run, the next victim is one of the waiting
    head's cached prefix blocks (nobody else holds it), and no earlier victim is."""
    found = []
    plain = Scheduler.burst_room

    def checked(self: Scheduler, want: int) -> int | None:
        room = plain(self, want)
        pool, head = self.pool, self.waiting[0]
        empty = pool.num_empty_blocks
        if room is None or head.computed is None or want <= empty or room >= pool.num_free_blocks:
            return room
        order = pool.policy.next_victims(want - empty).tolist()
        hits = {b for b in np.asarray(head.computed.blocks).tolist() if pool.ref[b] == 0}
        if room - empty < len(order):
            assert order[room - empty] in hits
            found.append(room)
        assert not hits.intersection(order[: room - empty])
        return room

    monkeypatch.setattr(Scheduler, "burst_room", checked)
    replay(True, "lru")
    assert found  # the case did come up
