"""The router's predicted hit on a hybrid worker is what the worker serves: the full-attention
group's prefix cut by the window, chunk and state groups' rules (vLLM's hybrid coordinator), learned
from each group's KV events. Checked against the engine's own pool on random event streams, on a
gpt-oss-shaped case by hand, and under hostile events."""

from __future__ import annotations

import random
from functools import partial

import pytest

from agentkv.cli import main
from agentkv.kv.events import AllBlocksCleared, BlockRemoved, BlockStored
from agentkv.kv.groups import GroupSpec, HybridPool
from agentkv.kv.interface import PoolRequest
from agentkv.route.index import BlockIndex, Match, TenantIndex

BS = 4
KIND = {"full": "full_attention", "sliding": "sliding_window", "chunked": "chunked_local_attention"}


def _stored(hashes, g, kind, medium="GPU", block_size=16):
    return BlockStored(
        block_hashes=hashes, group_idx=g, kv_cache_spec_kind=kind, medium=medium, block_size=block_size
    )


def _drive(pool: HybridPool, rng: random.Random, running: dict, i: int) -> tuple[list[int], int]:
    """One random step on `pool` (admit a prompt from its hit, advance, or free); returns a query."""
    if running and rng.random() < 0.5:
        rid = rng.choice(sorted(running))
        r, done, n = running[rid]
        step = min(rng.randrange(1, 12), n + 6 - done)
        if step > 0 and pool.allocate_slots(r, step, done):
            running[rid] = (r, done + step, n)
        if rng.random() < 0.25 or done >= n + 6:
            pool.free(rid)
            del running[rid]
    else:
        base = rng.randrange(4) * 100  # four sessions' prefixes
        r = PoolRequest(f"r{i}", [base + j for j in range(rng.randrange(1, 14))])
        n = len(r.block_hashes) * BS + rng.randrange(0, BS)
        c = pool.get_computed_blocks(r.block_hashes, n)
        first = min(n - c.hit * BS, rng.randrange(1, 20))
        if first > 0 and pool.allocate_slots(r, first, c.hit * BS, c):
            running[r.request_id] = (r, c.hit * BS + first, n)
    base = rng.randrange(4) * 100
    n_blocks = rng.randrange(1, 15)
    return [base + j for j in range(n_blocks)], n_blocks * BS + rng.choice((0, 0, 1, 3))


@pytest.mark.parametrize(
    "specs",
    [
        [("full", 10), ("sliding", 10, 9)],  # gpt-oss: full + window
        [("full", 10), ("sliding", 7, 9), ("chunked", 5, 16), ("state", 40)],  # every kind at once
        [("full", 10), ("state", 40)],  # Qwen3-Next: full + linear-attention states
    ],
)
def test_predicted_hit_equals_the_pools_hit_on_random_event_streams(specs):
    """A real HybridPool's events, as its worker publishes them, feed the router's index; after
    every step the predicted hit of a random prompt equals the pool's own lookup, once every group
    has stored. Until then (a window group caches only the window before a prompt's replay boundary
    or a junction; a state group only the state there, when a chunk ends on it) the groups not heard
    from are unknown and the worker looks as dense as they (docs/route.md): at least the pool's hit."""
    groups = [GroupSpec(*s, event_kind=KIND.get(s[0], "mamba")) for s in specs]
    pool = HybridPool(groups, 900, BS, record_events=True)
    index = TenantIndex(windows={"sliding": 9, "chunked": 16}, block_size=BS)
    rng, running, checked, cut, exact = random.Random(5), {}, 0, 0, 0
    for i in range(500):
        hashes, tokens = _drive(pool, rng, running, i)
        for ev in pool.take_events():
            index.apply(0, ev)
        want = pool.get_computed_blocks(hashes, tokens, count=False).hit
        got = index.find_matches("", hashes, tokens).get(0, Match(0)).gpu
        if len(index.groups._others.get(0, {})) == len(specs) - 1:  # every other group stored
            assert got == want, (i, hashes, tokens)
            exact += 1
        else:
            assert got >= want, (i, hashes, tokens)
        full = index.indexes[""].tier_prefix(0, hashes)
        checked += want > 0
        cut += full > want
    assert checked > 50 and cut > 20  # hits were predicted, and many needed the other groups' rules
    assert exact > 250  # most steps after every group was heard from
    assert pool.stats.evicted > 0 and index.groups.counts()["removed"] > 0


def test_gpt_oss_window_needs_the_blocks_before_the_cut():
    """Window 128 tokens at block size 16: a hit needs the 8 blocks before its cut. A prompt of
    exactly 32 blocks is served to block 31 (the last token is recomputed): the window must cover
    blocks 23..30."""
    for idx in (TenantIndex(windows={"sliding": 128}), BlockIndex()):
        if isinstance(idx, BlockIndex):
            idx.groups.windows["sliding"] = 128
        find = idx.find_matches if isinstance(idx, BlockIndex) else partial(idx.find_matches, "")
        a = list(range(1, 33))
        idx.apply(0, _stored(a, 0, "full_attention"))
        idx.apply(0, _stored(a, 1, "sliding_window"))
        idx.apply(0, BlockRemoved(block_hashes=a[:24], group_idx=1))  # the window keeps blocks 24..31
        assert find(a, 32 * 16 + 5) == {0: Match(32)}  # the cut at 32: blocks 24..31 cover it
        assert find(a, 32 * 16) == {0: Match(0)}  # the cut at 31 needs block 23: gone; none leads from 0
        idx.apply(0, _stored(a[22:24], 1, "sliding_window", block_size=16))
        assert find(a, 32 * 16) == {0: Match(31)}
        assert find(a[:20], None) == {0: Match(0)}  # no 8-run within the first 20 blocks


def test_state_groups_serve_up_to_the_last_saved_state():
    idx = TenantIndex()
    a = [11, 12, 13, 14, 15, 16]
    idx.apply(2, _stored([13], 0, "mamba"))  # states first (Kimi-style layouts)
    idx.apply(2, _stored(a, 1, "full_attention"))
    idx.apply(2, _stored([16], 0, "mamba"))
    assert idx.find_matches("", a, 6 * 16 + 1) == {2: Match(6)}
    assert idx.find_matches("", a, 6 * 16) == {2: Match(3)}  # the cut at 5: the state at 3 is next
    idx.apply(2, BlockRemoved(block_hashes=[13], group_idx=0))
    assert idx.find_matches("", a, 6 * 16) == {2: Match(0)}


def test_hostile_group_events_are_refused_or_ignored_without_a_crash():
    idx = TenantIndex(windows={"sliding": 32}, max_blocks=50)
    a = [1, 2, 3, 4, 5, 6]
    idx.apply(0, _stored(a, 0, "full_attention"))
    idx.apply(0, _stored(a, 1, "sliding_window"))
    # removals from groups never seen, negative and huge indexes, a nil kind, an unknown kind
    idx.apply(0, BlockRemoved(block_hashes=a, group_idx=7))
    idx.apply(0, BlockRemoved(block_hashes=a, group_idx=-1))
    idx.apply(0, _stored([99], 1 << 40, "no_such_kind"))
    idx.apply(0, _stored(a, 5, None))
    idx.apply(0, _stored(a, 3, "cross_attention"))
    assert idx.find_matches("", a, 6 * 16 + 1) == {0: Match(6)}
    # kind mismatch: group 1 now claims to be full attention, group 0 a window: both refused
    idx.apply(0, _stored([7, 8], 1, "full_attention"))
    idx.apply(0, _stored([7, 8], 0, "sliding_window"))
    assert idx.find_matches("", a + [7, 8], 8 * 16 + 1) == {0: Match(6)}
    assert idx.groups.counts()["refused"] == 4
    # a window group's lower-tier copy is not a GPU block; a flood past --max-index-blocks is refused
    idx.apply(0, BlockRemoved(block_hashes=[6], group_idx=1, medium="CPU"))
    idx.apply(0, _stored(list(range(100, 200)), 1, "sliding_window", block_size=0))
    assert idx.find_matches("", a, 6 * 16 + 1) == {0: Match(6)} and idx.groups.counts()["held"] == 6
    idx.apply(0, AllBlocksCleared())
    assert idx.find_matches("", a, 100) == {} and not idx.groups.hybrid


def test_dense_predictions_are_unchanged():
    """No groups (vLLM before 0.32, SGLang) or one full group: the full prefix, uncapped, as before."""
    idx = TenantIndex()
    idx.apply(0, BlockStored(block_hashes=[1, 2, 3]))
    idx.apply(1, _stored([1, 2], 0, "full_attention"))
    assert idx.find_matches("", [1, 2, 3], 48) == {0: Match(3), 1: Match(2)} and not idx.groups.hybrid


@pytest.mark.parametrize("flag", ["--sliding-window=-1", "--attention-chunk-size=99999999999"])
def test_bad_window_flags_are_one_line_errors(flag, capsys):
    assert main(["route", "--worker", "http://127.0.0.1:9", flag]) == 2
    err = capsys.readouterr().err.strip()
    assert "--sliding-window" in err and "\n" not in err
