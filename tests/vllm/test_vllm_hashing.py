"""agentkv's vLLM-exact block hashing against the `block_hashes` of a live vLLM's BlockStored events.

Two servers: `main` (sha256, PYTHONHASHSEED unset; vLLM binds its PUB socket on `tcp://*:PORT`, we
connect) and `evict` (sha256_cbor, PYTHONHASHSEED=4242; vLLM connects, so we bind). Each is asked for
prompts with and without `cache_salt`, a continuation that extends a cached prefix, and a decode
that fills blocks with generated tokens; every stored hash and parent must be agentkv's, bit for bit.
"""

from __future__ import annotations

import random
import time

import pytest
from vllm_server import EVICT_BLOCKS

from agentkv.events.subscriber import ZmqEventSubscriber
from agentkv.kv.events import BlockStored
from agentkv.kv.hashing import VllmHasher, make_hasher

pytestmark = pytest.mark.vllm

BS = 32
# ../shared/vllm/README.md: prompt 1..64 on sha256 without PYTHONHASHSEED, unsalted and salted "s1"
KNOWN = {None: [11290800355336220572, 11189021207153552290], "s1": [9814989143922616389, 6078964196695249834]}
CASES = [("main", "sha256", None), ("evict", "sha256_cbor", "4242")]  # (server, its algorithm and seed)


def _stored(sub: ZmqEventSubscriber, n_blocks: int, timeout: float = 30.0) -> list[BlockStored]:
    """BlockStored events, in order, until they hold `n_blocks` blocks."""
    out: list[BlockStored] = []
    deadline = time.monotonic() + timeout
    while sum(len(e.block_hashes) for e in out) < n_blocks:
        assert time.monotonic() < deadline, f"only {out} arrived"
        r = sub.recv(0.5)
        if r is not None:
            out += [e for e in r.batch.events if isinstance(e, BlockStored)]
    return out


def _subscribe(server, rng: random.Random) -> ZmqEventSubscriber:
    """A subscriber that has seen a live batch (so nothing sent after this is missed)."""
    sub = ZmqEventSubscriber(
        server.events, server.replay, topic="kv-events", bind=not server.spec.bind_events
    )
    deadline = time.monotonic() + 60
    while True:  # ZMQ joins asynchronously: probe with fresh prompts until a batch arrives
        assert time.monotonic() < deadline, "no KV event batch arrived from vLLM"
        server.complete([rng.randrange(1000, 31000) for _ in range(BS)], max_tokens=1)
        if sub.recv(1.0) is not None:
            break
    while sub.recv(0.3) is not None:  # drain what the probes left
        pass
    return sub


@pytest.mark.parametrize(
    ("server", "algo", "seed"), CASES, ids=[c[0] + "-" + c[1] for c in CASES], indirect=["server"]
)
def test_block_hashes_match_live_events(server, algo, seed, figures):
    name = server.name
    assert server.spec.hash_algo == algo and server.spec.python_hash_seed == seed
    hasher = make_hasher(algo, seed) if seed is not None else VllmHasher(algo, None)
    other_seed = VllmHasher(algo, "1" if seed is None else None)
    other_algo = VllmHasher("sha256_cbor" if algo == "sha256" else "sha256", seed)
    rng = random.Random(f"{name}-{algo}")
    server.reset_prefix_cache()  # nothing cached: every prompt below stores its blocks anew
    checked = 0
    with _subscribe(server, rng) as sub:
        # prompt 1..64, with and without a salt (the salt shows as extra_keys of the first block)
        for salt in (None, "s1"):
            prompt = list(range(1, 65))
            server.complete(prompt, **({"cache_salt": salt} if salt else {}))
            (ev,) = _stored(sub, 2)
            assert ev.block_hashes == hasher.event_hashes(prompt, BS, salt)
            assert ev.parent_block_hash is None and ev.token_ids == prompt
            assert ev.extra_keys == ([[salt], None] if salt else [None, None])
            if algo == "sha256" and seed is None:
                assert ev.block_hashes == KNOWN[salt]
            assert ev.block_hashes != other_seed.event_hashes(prompt, BS, salt)
            assert ev.block_hashes != other_algo.event_hashes(prompt, BS, salt)
            checked += 2

        # a salted prompt, then a continuation: only the new blocks are stored, chained to the cached ones
        salt = f"tenant-{name}"
        first = [rng.randrange(1000, 31000) for _ in range(150)]  # 4 full blocks and a partial one
        more = first + [rng.randrange(1000, 31000) for _ in range(100)]  # 7 full blocks
        server.complete(first, cache_salt=salt)
        stored = _stored(sub, 4)
        chain = hasher.chain(first, BS, cache_salt=salt)
        assert [h for e in stored for h in e.block_hashes] == chain.keys
        usage = server.complete(more, cache_salt=salt)["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 4 * BS
        (ev,) = _stored(sub, 3)
        assert ev.parent_block_hash == chain.keys[-1]
        assert ev.block_hashes == hasher.event_hashes(more, BS, salt)[4:]
        assert ev.block_hashes == hasher.event_hashes(more[4 * BS : 7 * BS], BS, parent=chain.tail)
        checked += 7

        # decode fills blocks with generated tokens: the events carry them, and they hash as agentkv's
        prompt = [rng.randrange(1000, 31000) for _ in range(40)]
        server.complete(prompt, max_tokens=60)  # 99 tokens computed: 3 full blocks
        stored = _stored(sub, 3)
        tokens = [t for e in stored for t in e.token_ids]
        assert tokens[:40] == prompt and len(tokens) == 3 * BS
        seq = hasher.sequence(BS)
        seq.extend(tokens)
        assert [h for e in stored for h in e.block_hashes] == seq.keys
        checked += 3
    figures[f"hashing {name}"] = (
        f"{algo}, PYTHONHASHSEED={'unset' if seed is None else seed}: {checked} block "
        "hashes from live BlockStored events reproduced bit for bit"
    )


def test_make_hasher_reads_pythonhashseed_as_vllm(monkeypatch):
    """Without an explicit seed, make_hasher takes PYTHONHASHSEED from the environment, as vLLM does."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert make_hasher("sha256").event_hashes(list(range(1, 65)), BS) == KNOWN[None]
    monkeypatch.setenv("PYTHONHASHSEED", "4242")
    assert make_hasher("sha256_cbor").none_hash == VllmHasher("sha256_cbor", "4242").none_hash
    assert make_hasher("sha256").event_hashes(list(range(1, 65)), BS) != KNOWN[None]


def _events(sub: ZmqEventSubscriber, quiet: float = 1.0) -> list:
    """Every event until none arrives for `quiet` seconds."""
    out = []
    while (r := sub.recv(quiet)) is not None:
        out += r.batch.events
    return out


def _live_copies(server, rng: random.Random) -> tuple[dict[int, int], list, list[int]]:
    """Identical prompts sent at once until some block is stored twice, then the cache filled with
    other prompts: (block hash -> copies stored, every event seen, the duplicated prompt)."""
    from concurrent.futures import ThreadPoolExecutor

    with _subscribe(server, rng) as sub:
        copies: dict[int, int] = {}
        events: list = []
        for _ in range(5):  # retried with a fresh prompt if no block was stored twice
            prompt = [rng.randrange(1000, 31000) for _ in range(4 * BS)]
            with ThreadPoolExecutor(4) as ex:
                list(ex.map(server.complete, [prompt] * 4))
            events += _events(sub)
            stored = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
            copies = {h: stored.count(h) for h in set(stored) if stored.count(h) > 1}
            if copies:
                break
        assert copies, "four identical prompts never left two copies of a block"
        # fill the 320-block cache with other prompts: every free copy is evicted, one event each
        for _ in range(12):
            server.complete([rng.randrange(1000, 31000) for _ in range(32 * BS)], max_tokens=1)
        events += _events(sub)
    return copies, events, prompt


def _check_index_holds_until_last_copy(events: list, copies: dict[int, int]) -> None:
    """Replayed in order through the index, a duplicated block is held until its last removal."""
    from agentkv.kv.events import BlockRemoved
    from agentkv.route.index import BlockIndex

    idx, seen = BlockIndex(), dict.fromkeys(copies, 0)
    for e in events:
        idx.apply(0, e)
        if isinstance(e, BlockRemoved):
            for h in e.block_hashes:
                if h in seen:
                    seen[h] += 1
                    assert idx.holds(0, h) == (seen[h] < copies[h])


def _engine_copies(prompt: list[int]) -> dict[int, int]:
    """The copies agentkv's engine keeps of the prompt's blocks, by block position, after the same
    four requests (its pool does not de-duplicate either)."""
    from agentkv.engine.config import EngineConfig
    from agentkv.engine.engine import Engine

    ours: list = []
    eng = Engine(
        EngineConfig(
            block_size=BS,
            num_gpu_blocks_override=EVICT_BLOCKS,
            max_model_len=8192,
            max_num_batched_tokens=8192,
        ),
        on_event=ours.append,
    )
    for i in range(4):
        eng.add_request(f"r{i}", max_tokens=1, token_ids=prompt)
        while eng.requests:
            eng.step()
    ours_stored = [h for e in ours if isinstance(e, BlockStored) for h in e.block_hashes]
    position = {h: i for i, h in enumerate(eng.hasher.hashes(prompt, BS))}
    return {position[h]: ours_stored.count(h) for h in set(ours_stored) if ours_stored.count(h) > 1}


def test_duplicate_blocks_are_stored_and_removed_once_per_copy(evict_server, figures):
    """vLLM does not de-duplicate its cache: identical prompts can each leave a copy of a block
    (here the last one, which a fully cached prompt recomputes), and each copy is stored and later
    evicted with its own event. The router's index counts copies (tests/test_index.py), so a block
    stays indexed until its last copy goes."""
    from agentkv.kv.events import BlockRemoved

    server = evict_server
    rng = random.Random("duplicates")
    server.reset_prefix_cache()
    copies, events, prompt = _live_copies(server, rng)
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert {h: removed.count(h) for h in copies} == copies
    _check_index_holds_until_last_copy(events, copies)
    # agentkv's engine keeps the same copies of the same blocks (its pool does not de-duplicate either)
    ours_copies = _engine_copies(prompt)
    live_position = {
        h: i
        for e in events
        if isinstance(e, BlockStored) and prompt[:BS] == e.token_ids[:BS]
        for i, h in enumerate(e.block_hashes)
    }
    assert ours_copies == {live_position[h]: n for h, n in copies.items()}
    figures["duplicates"] = (
        f"4 identical prompts of 4 blocks: {len(copies)} block(s) stored in up to "
        f"{max(copies.values())} copies by a live vLLM, each copy stored and removed with its "
        "own event (agentkv's engine: the same copies); the index held the block until its "
        "last copy went"
    )
