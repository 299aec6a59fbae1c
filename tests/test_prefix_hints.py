"""Lookup hints filed by shared block keys: the table a new request gets holds its prefix, a stale
one is passed over, the store stays bounded, and a hinted lookup answers as a plain one."""

import numpy as np

from agentkv.kv.hints import PrefixHints
from agentkv.kv.interface import PoolRequest
from agentkv.kv.pool import BlockPool


def _run(pool: BlockPool, rid: str, keys: np.ndarray) -> np.ndarray:
    """Look up, allocate and free a whole prompt of `keys` (16-token blocks); its block table."""
    chain = keys.tolist()
    hit = pool.get_computed_blocks(chain, len(chain) * 16)
    n = hit.num_blocks * 16
    assert pool.allocate_slots(PoolRequest(rid, chain), len(chain) * 16 - n, n, hit)
    table = pool.block_table(rid)
    pool.free(rid)
    return table


def test_deepest_shared_table_that_still_holds_the_prefix():
    pool, hints = BlockPool(64, 16, "lru"), PrefixHints()
    rng = np.random.default_rng(1)
    system = rng.integers(0, 2**63, 4, dtype=np.uint64)
    a = np.concatenate((system, rng.integers(0, 2**63, 16, dtype=np.uint64)))  # 20 blocks
    b = np.concatenate((system, rng.integers(0, 2**63, 4, dtype=np.uint64)))  # shares 4 with a
    ta, tb = _run(pool, "a", a), _run(pool, "b", b)
    hints.add(a, ta)
    hints.add(b, tb)  # filed later, under the anchors it shares with a (keys 1 and 4)
    turn = np.concatenate((a, rng.integers(0, 2**63, 3, dtype=np.uint64)))  # a's next turn
    assert hints.get(turn, pool.holds) is ta  # a's table: its key at depth 16 is shared
    assert hints.get(b[:4], pool.holds) is tb  # depth 4: the latest table filed there
    plain = pool.get_computed_blocks(turn.tolist(), len(turn) * 16, count=False)
    hinted = pool.get_computed_blocks(turn.tolist(), len(turn) * 16, count=False, hint=ta, hash_array=turn)
    assert list(hinted.blocks) == list(plain.blocks) == ta[:20].tolist()
    _run(pool, "c", rng.integers(0, 2**63, 64, dtype=np.uint64))  # evicts everything
    assert hints.get(turn, pool.holds) is None  # stale tables are passed over
    assert hints.get(turn) is ta  # without a check, the deepest filed table


def test_store_is_bounded():
    hints = PrefixHints(limit=10)
    for i in range(50):
        keys = np.arange(i * 100, i * 100 + 20, dtype=np.uint64)
        hints.add(keys, np.arange(20))
    assert len(hints._tables) == 10
    assert hints.get(np.arange(4900, 4920, dtype=np.uint64)) is not None
    assert hints.get(np.arange(0, 20, dtype=np.uint64)) is None  # the oldest went first
