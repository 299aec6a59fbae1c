"""`cache analyze` on a model with hybrid KV groups (gpt-oss, Gemma 3, Qwen3-Next, DeepSeek-V4).

Each request runs alone through the engine's own `Scheduler` over a `HybridPool` (`kv/groups.py`):
the lookup takes what every group can serve (`kv/group_rules.py`), the prefill goes in chunks of
`max_num_batched_tokens` (cut on block boundaries for a state group, vLLM's 'align' mode, so states
are saved where the engine saves them), then the output as the engine's decode bursts (the window
frees what it has left), then free. So a cell is what the simulator's pool serves for the same
requests one at a time. Beside that model-level hit, each group's own figure: what its rule alone
would serve from its own cached blocks at the same moment (a full group's prefix, a window's last
window before the cut, a state's rightmost saved boundary).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from agentkv.cache.results import GroupFigure
from agentkv.engine.config import EngineConfig
from agentkv.engine.pools import seq_token_capacity
from agentkv.engine.request import EngineRequest
from agentkv.engine.scheduler import Scheduler
from agentkv.kv import group_rules as R
from agentkv.kv.groups import GroupSpec, HybridPool
from agentkv.trace.accesses import BlockRequest

CHUNK = EngineConfig().max_num_batched_tokens  # the engine's default prefill chunk


@dataclasses.dataclass(slots=True)
class GroupReplay:
    """Tokens of one replay: queried, served by every group (the hit), and by each group alone."""

    query_tokens: int
    hit_tokens: int
    alone: list[int]
    too_big: int
    evicted: int

    def figures(self, specs: Sequence[GroupSpec]) -> list[GroupFigure]:
        q = self.query_tokens
        return [
            GroupFigure(group=s.name or s.rule, rule=s.rule, hit_tokens=h, hit_rate=h / q if q else 0.0)
            for s, h in zip(specs, self.alone, strict=True)
        ]


def group_hit(pool: HybridPool, g: int, hashes: Sequence[int], limit: int) -> int:
    """Leading blocks group `g` alone could serve now, by its kind's rule (at most `limit`)."""
    s, cached = pool.specs[g], pool.cached_maps[g]
    if s.rule == "full":
        return R.full_hit(cached, hashes, limit)
    if s.rule == "state":
        return R.state_hit(cached, hashes, limit)
    hit = R.sliding_hit if s.rule == "sliding" else R.chunked_hit
    return hit(cached, hashes, limit, s.window, pool.block_size)


def _prefill(sched: Scheduler, req: EngineRequest) -> bool:
    """Schedule `req` (alone) until its prompt is computed; False, and dropped, if it cannot run."""
    sched.add(req)
    while req.num_computed < req.prompt_len:
        batch, _ = sched.schedule(0.0)
        if not batch:  # it cannot be admitted, or preempted itself: larger than the pool
            sched.finish(req)
            return False
        for r, n in batch:
            r.num_computed += n
    return True


def _decode(pool: HybridPool, req: EngineRequest, left: int) -> bool:
    """The output after the first token as the engine's decode bursts (`Engine.plan_burst`): as many
    steps as the free token blocks cover (each burst frees what the window left first), else one."""
    bs, nc = pool.block_size, req.num_computed
    while left > 0:
        k = min(left, (-(-nc // bs) + pool.free_token_blocks) * bs - nc)
        k = k if k >= 2 else 1
        if not pool.allocate_slots(req, k, nc):
            return False
        nc, left = nc + k, left - k
    return True


def replay_groups(pool: HybridPool, requests: Sequence[BlockRequest], chunk: int = CHUNK) -> GroupReplay:
    """Each request alone through the engine's scheduler over `pool`: lookup, chunked prefill, the
    decode burst, free. A request that cannot fit the whole pool is not run: its tokens all miss."""
    bs = pool.block_size
    sched = Scheduler(EngineConfig(max_num_batched_tokens=max(chunk, bs)), pool)
    most = seq_token_capacity(pool)  # the engine refuses longer sequences
    alone = [0] * len(pool.specs)
    queries = hits = too_big = 0
    for i, r in enumerate(requests):
        queries += r.input_tokens
        if r.input_tokens + r.output_tokens > most:
            too_big += 1
            continue
        hs = r.hashes
        limit = max(0, min(len(hs), (r.input_tokens - 1) // bs))
        got = [group_hit(pool, g, hs, limit) for g in range(len(alone))]
        req = EngineRequest(str(i), r.input_tokens, max(1, r.output_tokens), hs, r.time, session_id=r.session)
        if not _prefill(sched, req):
            too_big += 1
            continue
        ok = _decode(pool, req, r.output_tokens - 1)
        sched.finish(req)
        if not ok:
            too_big += 1
            continue
        hits += req.num_cached_tokens
        alone = [a + n * bs for a, n in zip(alone, got, strict=True)]
    return GroupReplay(queries, hits, alone, too_big, pool.stats.evicted)


def unbounded_replay(
    specs: Sequence[GroupSpec], requests: Sequence[BlockRequest], block_size: int
) -> GroupReplay:
    """The same replay with room for every block it ever makes, so nothing is evicted: the ceiling
    under each kind's rule. With nothing evicted, bytes do not matter: each block costs one."""
    keys = len({h for r in requests for h in r.hashes})
    most = max((-(-(r.input_tokens + r.output_tokens) // block_size) for r in requests), default=0)
    ones = tuple(dataclasses.replace(s, block_bytes=1) for s in specs)
    # each group caches a key at most once, and the running request holds at most `most` + 1 blocks
    pool = HybridPool(ones, len(ones) * (keys + most + 2), block_size)
    res = replay_groups(pool, requests)
    if res.evicted or res.too_big:
        raise RuntimeError(f"unbounded replay: {res.evicted} blocks evicted, {res.too_big} too big")
    return res
