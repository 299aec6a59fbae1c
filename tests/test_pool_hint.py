"""Hinted prefix lookups (the session's previous blocks checked in bulk) give exactly the plain result."""

import random

import numpy as np

from agentkv.kv.interface import PoolRequest
from agentkv.kv.pool import BlockPool


def test_hinted_lookup_equals_plain_lookup_under_churn():
    rng = random.Random(7)
    pool = BlockPool(400, 16, "lru")
    sessions = {s: [rng.getrandbits(64) for _ in range(rng.randint(5, 60))] for s in range(12)}
    last_blocks: dict[int, np.ndarray] = {}
    for step in range(300):
        s = rng.randrange(12)
        chain = sessions[s]
        if rng.random() < 0.7:  # the session grows, sometimes diverging after a prefix
            cut = len(chain) if rng.random() < 0.8 else rng.randint(1, len(chain))
            chain = chain[:cut] + [rng.getrandbits(64) for _ in range(rng.randint(1, 20))]
            sessions[s] = chain
        hint = last_blocks.get(s)
        if hint is not None and rng.random() < 0.2:  # a wrong hint must not change the answer
            hint = np.asarray(rng.sample(range(400), min(len(hint), 50)), dtype=np.int64)
        arr = np.asarray(chain, dtype=np.uint64)
        tokens = len(chain) * 16 + 5
        plain = pool.get_computed_blocks(chain, tokens, count=False)
        hinted = pool.get_computed_blocks(chain, tokens, hint=hint, hash_array=arr)
        assert list(hinted.blocks) == list(plain.blocks), step
        rid = f"r{step}"
        n = hinted.num_blocks
        if pool.allocate_slots(PoolRequest(rid, chain), tokens - n * 16, n * 16, hinted):
            last_blocks[s] = np.asarray(pool.request_blocks(rid), dtype=np.int64)
            pool.free(rid)
    pool.check_invariants()
