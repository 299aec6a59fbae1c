"""`agentkv cache analyze`: token hit rate of each eviction policy over a grid of capacities and block sizes.

A model with hybrid KV groups replays through the engine's `HybridPool` instead (`cache/groups.py`),
every policy but Belady, with each group's own figure beside the model-level hit.

The traces' block accesses (agentkv.trace.accesses) are replayed through a `BlockPool` per
(block size, capacity, policy) cell: lookup, allocate prompt + output, free, one request at a
time, so capacity is pure cache room. Belady's offline optimum and the unbounded cache are the
reference rows: no policy beats the unbounded cache, and Belady is the practical ceiling at a
capacity. With a CPU tier, GPU misses are looked up below and promoted, and hits split by tier.
Cells run in forked worker processes that share the (read-only) accesses.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass

from agentkv.cache.grid import Grid, GroupLayout
from agentkv.cache.groups import replay_groups, unbounded_replay
from agentkv.cache.replay import replay
from agentkv.cache.results import Analysis, Ceiling, CellResult, KVGroup
from agentkv.engine.pools import hybrid_pool
from agentkv.errors import UserError
from agentkv.kv.eviction import make_policy
from agentkv.kv.interface import PoolRequest
from agentkv.kv.pool import BlockPool
from agentkv.kv.tiers import TierSpec, TierStack
from agentkv.terminal import ignore_sigint
from agentkv.trace.accesses import Arrival, BlockRequest, arrivals, block_accesses
from agentkv.trace.ceiling import ceiling_tokens
from agentkv.trace.model import Trace


def replay_tiered(pool: BlockPool, requests: Sequence[BlockRequest]) -> tuple[int, int, int, int]:
    """`replay` with the pool's lower tiers: a GPU miss's run found below is promoted, not recomputed.

    Returns (query tokens, GPU hit tokens, lower-tier hit tokens, failed requests). Session
    hints as `replay(hints=True)` gives them.
    """
    bs = pool.block_size
    # the pool evicts GPU blocks (demoting them below) before it promotes, so the C - n blocks a
    # request takes could push its own matched (and touched) run out of a small tier: look up at
    # most room - (C - n) blocks below, which survive that, and recompute the rest
    room = min(cap for _, cap in pool.lower.occupancy().values())
    q0, h0 = pool.stats.queries, pool.stats.hits
    lower_hits = failed = 0
    for i, r in enumerate(requests):
        rid = str(i)
        pool.session_resumed(r.session, r.time)
        hs = r.hashes
        computed = pool.get_computed_blocks(hs, r.input_tokens)
        n = computed.num_blocks
        limit = max(0, min(len(hs), (r.input_tokens - 1) // bs))
        total = r.input_tokens + r.output_tokens
        k = min(limit - n, room - (-(-total // bs) - n))
        m = computed.num_lower = len(pool.match_lower(hs, n, n + k)) if k > 0 else 0
        if pool.allocate_slots(
            PoolRequest(rid, hs, r.session, prompt_len=r.input_tokens), total - (n + m) * bs, n * bs, computed
        ):
            lower_hits += m * bs
            pool.free(rid)
        else:
            failed += 1
        pool.session_paused(r.session, r.end, r.stop)
        if r.last:
            pool.session_ended(r.session, r.end)
    return pool.stats.queries - q0, pool.stats.hits - h0, lower_hits, failed


def fitting(requests: Sequence[BlockRequest], num_blocks: int, block_size: int) -> list[BlockRequest]:
    """The requests whose prompt + output fit in `num_blocks`, lanes' last flags set anew.

    Requests run one at a time, so one fails iff it is larger than the whole pool: it is left out
    of the replay (and of Belady's future) and counts as a query with no hit.
    """
    fit = [r for r in requests if -(-(r.input_tokens + r.output_tokens) // block_size) <= num_blocks]
    if len(fit) == len(requests):
        return fit
    last = {r.session: i for i, r in enumerate(fit)}
    for i, r in enumerate(fit):
        if (last[r.session] == i) != r.last:
            fit[i] = BlockRequest(
                r.time,
                r.end,
                r.session,
                r.hashes,
                r.input_tokens,
                r.output_tokens,
                r.stop,
                last[r.session] == i,
            )
    return fit


def run_cell(
    grid: Grid, requests: Sequence[BlockRequest], block_size: int, capacity: tuple[str, int], policy: str
) -> CellResult:
    """Replay `requests` through a fresh pool of `capacity` with `policy` (and the grid's CPU tier)."""
    t0 = time.perf_counter()
    label, nbytes = capacity
    layout = grid.layout(block_size)
    if layout is not None:
        return _group_cell(grid, layout, requests, block_size, capacity, policy, t0)
    block_bytes = block_size * grid.kv_bytes_per_token
    num_blocks = nbytes // block_bytes
    queries = sum(r.input_tokens for r in requests)
    fit = fitting(requests, num_blocks, block_size)
    evictor = make_policy(policy, accesses=[r.hashes for r in fit] if policy == "belady" else None)
    lower = None
    if grid.cpu is not None:
        lower = TierStack(
            _cpu_tier(grid),
            block_bytes,
            block_size=block_size,
            num_layers=grid.num_layers,
        )
    pool = BlockPool(num_blocks, block_size, evictor, lower=lower)
    if lower is None:
        res = replay(pool, fit, hints=True)
        gpu, below, failed = res.hit_tokens, 0, res.failed
        tiers = {"GPU": gpu}
    else:
        _, gpu, below, failed = replay_tiered(pool, fit)
        tiers = {"GPU": gpu, "CPU": below}
    if failed:  # cannot happen one request at a time; a failed lookup would count hits it never got
        raise RuntimeError(f"{failed} requests failed to allocate in an otherwise empty pool")
    hits = gpu + below
    return CellResult(
        block_size=block_size,
        capacity=label,
        capacity_bytes=nbytes,
        num_blocks=num_blocks,
        policy=policy,
        hit_rate=hits / queries if queries else 0.0,
        hit_tokens=hits,
        query_tokens=queries,
        tier_hit_tokens=tiers,
        too_big=len(requests) - len(fit),
        evicted=pool.stats.evicted,
        seconds=time.perf_counter() - t0,
    )


def _cpu_tier(grid: Grid) -> list[TierSpec]:
    """The grid's `--cpu` tier ([] without one)."""
    return [] if grid.cpu is None else [TierSpec("CPU", capacity_bytes=grid.cpu[1])]


def _group_cell(
    grid: Grid,
    layout: GroupLayout,
    requests: Sequence[BlockRequest],
    bs: int,
    capacity: tuple[str, int],
    policy: str,
    t0: float,
) -> CellResult:
    """A hybrid model's cell: the engine's pool of `capacity` bytes shared by its groups, with
    `policy` and the grid's CPU tier, built as the engine builds it (`engine.pools.hybrid_pool`)."""
    pool = hybrid_pool(
        layout.specs, capacity[1], bs, layout.page_bytes, layout.page_layers, _cpu_tier(grid), policy
    )
    res = replay_groups(pool, requests)
    q = res.query_tokens
    return CellResult(
        block_size=bs,
        capacity=capacity[0],
        capacity_bytes=capacity[1],
        num_blocks=pool.num_blocks,  # vLLM's pages
        policy=policy,
        hit_rate=res.hit_tokens / q if q else 0.0,
        hit_tokens=res.hit_tokens,
        query_tokens=q,
        tier_hit_tokens=res.tiers,
        too_big=res.too_big,
        evicted=res.evicted,
        seconds=time.perf_counter() - t0,
        groups=res.figures(layout.specs),
    )


# the accesses per block size, set before forking so that worker processes inherit them
_SHARED: dict[str, object] = {}


def _run_shared(block_size: int, capacity: tuple[str, int], policy: str) -> CellResult:
    args = (_SHARED["grid"], _SHARED["requests"][block_size], block_size, capacity, policy)
    if policy != "belady":
        return run_cell(*args)
    with _SHARED["belady_lock"]:  # one at a time: its future-use index takes ~60 bytes per access
        return run_cell(*args)


def default_jobs() -> int:
    """Worker processes: the cores this process may use, at most 4 (each holds a pool)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(4, n))


_Cell = tuple[int, tuple[str, int], str]  # (block size, (capacity label, bytes), policy)


@dataclass(slots=True)
class _Progress:
    """Counts finished steps and reports each one to the caller's `progress` callback, if any."""

    callback: Callable[[int, int, str], None] | None
    total: int
    done: int = 0
    stop: object = None  # anything with a `requested` flag (agentkv.terminal.StopRequest)

    def stopped(self) -> bool:
        return bool(getattr(self.stop, "requested", False))

    def step(self, what: str) -> None:
        self.done += 1
        if self.callback:
            self.callback(self.done, self.total, what)


def _accesses(
    arrived: list[Arrival], grid: Grid, tick: _Progress
) -> tuple[dict[int, list[BlockRequest]], list[Ceiling]]:
    """The block accesses and the unbounded-cache ceiling at each block size (for a hybrid model,
    the unbounded replay under each group's rule)."""
    requests: dict[int, list[BlockRequest]] = {}
    ceilings = []
    for bs in grid.block_sizes:
        reqs = requests[bs] = block_accesses(arrived, bs)
        q = sum(r.input_tokens for r in reqs)
        layout, groups = grid.layout(bs), []
        if layout is None:
            h = ceiling_tokens(reqs, bs)
        else:
            res = unbounded_replay(layout.specs, reqs, bs)
            h, groups = res.hit_tokens, res.figures(layout.specs)
        rate = h / q if q else 0.0
        ceilings.append(Ceiling(block_size=bs, hit_rate=rate, hit_tokens=h, query_tokens=q, groups=groups))
        tick.step(f"block size {bs}: accesses and ceiling")
    return requests, ceilings


def _kv_groups(grid: Grid) -> list[KVGroup]:
    """The hybrid model's groups with their block bytes at each block size (empty for one table)."""
    lays = [grid.layout(bs) for bs in grid.block_sizes]
    if lays[0] is None:
        return []
    return [
        KVGroup(name=s.name, rule=s.rule, window=s.window, block_bytes=[x.specs[g].block_bytes for x in lays])
        for g, s in enumerate(lays[0].specs)
    ]


def _run_cells(
    grid: Grid,
    requests: dict[int, list[BlockRequest]],
    cells: list[_Cell],
    jobs: int,
    tick: _Progress,
    ray: str | None = None,
) -> list[CellResult]:
    """Every cell's result, in `cells` order: here one by one, in `jobs` forked workers, or as Ray
    tasks; on a stop request, the cells finished so far."""
    if ray is not None:  # the cells as Ray tasks on the cluster at `ray`
        from agentkv.cache.ray_cells import run_on_ray

        return run_on_ray(grid, requests, cells, ray, tick)
    jobs = max(1, min(jobs, len(cells)))
    if jobs > 1 and "fork" in mp.get_all_start_methods():
        return _run_forked(grid, requests, cells, jobs, tick)
    results = []
    for cell in cells:
        if tick.stopped():
            break
        results.append(run_cell(grid, requests[cell[0]], *cell))
        tick.step(f"{cell[2]} at {cell[1][0]}, block size {cell[0]}")
    return results


def _run_forked(
    grid: Grid, requests: dict[int, list[BlockRequest]], cells: list[_Cell], jobs: int, tick: _Progress
) -> list[CellResult]:
    """The cells run in `jobs` forked workers that inherit the accesses, sorted back to `cells` order.
    On a stop request the cells in hand are dropped (their workers ended) and the rest cancelled."""
    results: list[CellResult] = []
    ctx = mp.get_context("fork")
    _SHARED.update(grid=grid, requests=requests, belady_lock=ctx.Lock())
    ex = ProcessPoolExecutor(jobs, mp_context=ctx, initializer=ignore_sigint)
    pending = {ex.submit(_run_shared, *cell) for cell in cells}
    try:
        while pending and not tick.stopped():
            done, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
            for fut in done:
                r = fut.result()
                results.append(r)
                tick.step(f"{r.policy} at {r.capacity}, block size {r.block_size}")
    finally:
        # Stopped: end the workers first, then join the pool's manager thread, so no pool is left
        # for the interpreter's exit hook (it raced with the closed pipes: "Bad file descriptor").
        workers = list((getattr(ex, "_processes", None) or {}).values()) if pending else []
        for w in workers:
            w.terminate()
        ex.shutdown(wait=True, cancel_futures=True)
        _SHARED.clear()
    order = {(bs, cap[0], pol): i for i, (bs, cap, pol) in enumerate(cells)}
    results.sort(key=lambda r: order[(r.block_size, r.capacity, r.policy)])
    return results


def analyze(
    traces: Sequence[Trace],
    grid: Grid,
    *,
    jobs: int = 1,
    progress: Callable[[int, int, str], None] | None = None,
    stop: object = None,
    ray: str | None = None,
) -> Analysis:
    """Run every cell of `grid` on `traces`; `progress(done, total, what)` after each cell. When
    `stop.requested` turns true (Ctrl-C), the cells finished so far, marked `interrupted`. With `ray`
    (an address, or `local`) the cells run as Ray tasks."""
    t0 = time.perf_counter()
    if not any(t.num_requests for t in traces):
        raise UserError("cache analyze: the traces hold no requests")
    arrived = arrivals(traces, grid.concurrency)
    cells = [(bs, cap, pol) for bs in grid.block_sizes for cap in grid.capacities for pol in grid.policies]
    tick = _Progress(progress, len(cells) + len(grid.block_sizes), stop=stop)
    requests, ceilings = _accesses(arrived, grid, tick)
    results = _run_cells(grid, requests, cells, jobs, tick, ray)
    return Analysis(
        model=grid.model,
        kv_cache_dtype=grid.kv_dtype,
        kv_bytes_per_token=grid.kv_bytes_per_token,
        traces=len(traces),
        requests=len(arrived),
        input_tokens=sum(a.request.input_tokens for a in arrived),
        order="concurrency" if grid.concurrency else "timestamps",
        concurrency=grid.concurrency,
        cpu=grid.cpu[0] if grid.cpu else None,
        cpu_bytes=grid.cpu[1] if grid.cpu else None,
        capacities=[c[0] for c in grid.capacities],
        block_sizes=list(grid.block_sizes),
        policies=list(grid.policies),
        ceilings=ceilings,
        results=results,
        seconds=time.perf_counter() - t0,
        interrupted=len(results) < len(cells),
        kv_groups=_kv_groups(grid),
    )
