"""A discrete-event simulation of N engines behind a routing policy, replaying agentic traces.

The replay plan (agentkv.trace.plan) decides when each request is due; the router picks a worker;
each worker is an `Engine` on its own virtual clock that runs one step at a time. Events are
processed in time order: a step's outputs land at its end, and plan releases at the same instant
come after them. The result is the same per-request records and summary `agentkv bench` writes.
"""

from __future__ import annotations

import bisect
import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from agentkv.engine.config import EngineConfig
from agentkv.engine.engine import DecodeBurst, Engine, StepResult
from agentkv.engine.hardware import get_gpu
from agentkv.errors import UserError
from agentkv.metrics.records import RequestRecord, record_for
from agentkv.metrics.summary import Sample, Summary, summarize
from agentkv.placement import POLICIES
from agentkv.placement.policy import KV_WEIGHT, RouteRequest, make_policy
from agentkv.trace.blocks import chain_keys
from agentkv.trace.ceiling import CeilingTracker
from agentkv.trace.model import Trace
from agentkv.trace.plan import Dispatch, ReplayPlan

STEP_END, BURST_END, START = 0, 1, 2


@dataclass(slots=True)
class SimConfig:
    """A simulated cluster: one engine config for every worker, the router and the replay plan."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    workers: int = 1
    lanes: int = 16
    router: str = "kv_aware"
    kv_weight: float = KV_WEIGHT  # kv_aware only
    seed: int = 0
    warm_start: bool = False
    idle_gap_cap: float | None = 10.0
    max_requests: int | None = None
    duration: float | None = None  # simulated seconds after which no new request is released
    sample_every: float = 1.0  # simulated seconds between timeline samples
    bursts: bool = True  # run pure-decode stretches as one event (same results, far fewer events)

    def __post_init__(self) -> None:
        if self.workers < 1 or self.lanes < 1:
            raise UserError("--workers and --lanes must be >= 1")
        if not self.kv_weight >= 0:
            raise UserError(f"--kv-weight must be >= 0, got {self.kv_weight}")
        if self.router not in POLICIES:
            raise UserError(f"--router: '{self.router}' is not one of {', '.join(POLICIES)}")


class SimWorker:
    """One engine as the router sees it (the `WorkerView` protocol), plus what it is running now."""

    __slots__ = ("index", "engine", "pending", "burst", "version", "starting", "_cached")

    def __init__(self, index: int, engine: Engine):
        self.index = index
        self.engine = engine
        self.pending: StepResult | None = None  # the single step in flight
        self.burst: DecodeBurst | None = None  # or the decode burst in flight
        self.version = 0  # bumped when a burst is cut short, so its end event is ignored
        self.starting = False  # busy until a scheduled start event (after a cut burst)
        self._cached = engine.pool.cached

    def idle(self) -> bool:
        return self.pending is None and self.burst is None and not self.starting

    def active_requests(self) -> int:
        return self.engine.num_running + self.engine.num_waiting

    def active_blocks(self) -> int:
        pool = self.engine.pool
        return pool.num_blocks - pool.num_free_blocks

    def cached_prefix(self, block_hashes: Sequence[int]) -> tuple[int, int]:
        """Leading blocks cached on the GPU, then in lower tiers, found by bisection: exact when the
        cache holds prefixes whole, as LRU with tail-first freeing keeps it (what an index knows)."""
        gpu = _prefix_len(self._cached.__contains__, block_hashes, 0)
        lower = self.engine.pool.lower
        return gpu, (_prefix_len(lower.__contains__, block_hashes, gpu) - gpu if lower is not None else 0)


def _prefix_len(has, hashes: Sequence[int], start: int) -> int:
    """Index of the first hash at/after `start` that `has` lacks, by bisection (prefix-closed sets)."""
    n = len(hashes)
    if start >= n or not has(hashes[start]):
        return start
    if has(hashes[n - 1]):
        return n
    lo, hi = start, n - 1  # has(lo), not has(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if has(hashes[mid]):
            lo = mid
        else:
            hi = mid
    return hi


class SimResult:
    def __init__(self, records: list[RequestRecord], summary: Summary, wall_s: float, sim_s: float):
        self.records, self.summary, self.wall_s, self.sim_s = records, summary, wall_s, sim_s


def _max_len_for(traces: Sequence[Trace]) -> int:
    return max(
        (r.input_tokens + max(1, r.output_tokens) for t in traces for s in t.sessions() for r in s.requests),
        default=1,
    )


def simulate(
    traces: Sequence[Trace], cfg: SimConfig, progress: Callable[[int, int], None] | None = None
) -> SimResult:
    """Replay `traces` on `cfg.workers` simulated engines; returns records and the summary."""
    wall0 = time.perf_counter()
    notes: list[str] = []
    ecfg = cfg.engine
    probe = Engine(ecfg) if ecfg.max_model_len is None else None
    if probe is not None:
        need = _max_len_for(traces)
        if need > probe.max_model_len:
            notes.append(
                f"max_model_len raised from the model's {probe.max_model_len} to {need} "
                "so that every trace request fits (pass --max-model-len to cap it)"
            )
            ecfg = EngineConfig(**{**asdict(ecfg), "max_model_len": need})
    itl: list[float] = []
    workers = [SimWorker(i, Engine(ecfg, itl_sink=itl)) for i in range(cfg.workers)]
    policy = make_policy(
        cfg.router, seed=cfg.seed, **({"weight": cfg.kv_weight} if cfg.router == "kv_aware" else {})
    )
    plan = ReplayPlan(
        traces,
        lanes=cfg.lanes,
        seed=cfg.seed,
        warm_start=cfg.warm_start,
        idle_gap_cap=cfg.idle_gap_cap,
        max_requests=cfg.max_requests,
    )
    bs = ecfg.block_size
    ceiling = CeilingTracker()
    records: list[RequestRecord] = []
    dispatched: dict[str, tuple[Dispatch, int, int]] = {}  # engine request id -> (dispatch, worker, ceiling)
    total = cfg.max_requests or sum(t.num_requests for t in traces)
    ends: list[tuple[float, int, int, int, int]] = []  # (time, seq, worker, version, kind)
    timeline: list[Sample] = []
    next_sample = 0.0
    max_len = workers[0].engine.max_model_len

    seq = 0

    def push(t: float, w: SimWorker, kind: int) -> None:
        nonlocal seq
        heapq.heappush(ends, (t, seq, w.index, w.version, kind))
        seq += 1

    def start_step(w: SimWorker, now: float) -> None:
        eng = w.engine
        eng.clock.advance_to(now)
        w.starting = False
        burst = eng.plan_burst() if cfg.bursts else None
        if burst is not None:
            w.burst = burst
            push(burst.ends[-1], w, BURST_END)
            return
        res = eng.step()
        w.pending = res
        if res is not None:
            push(res.end, w, STEP_END)

    def deliver(res: StepResult, now: float) -> None:
        for out in res.outputs:
            if not out.finished:
                continue
            req = out.request
            d, wi, ceil_tok = dispatched.pop(req.request_id)
            records.append(_record(d, req, wi, ceil_tok))
            plan.complete(d.item.id, now, True)

    def on_event(w: SimWorker, now: float, kind: int) -> None:
        if kind == STEP_END:
            res, w.pending = w.pending, None
        elif kind == BURST_END:
            burst, w.burst = w.burst, None
            res = w.engine.commit_burst(burst, len(burst.ends))
        else:
            res = None
        if res is not None:
            deliver(res, now)
        start_step(w, now)

    def cut_burst(w: SimWorker, now: float) -> None:
        """A request joins a worker mid-burst: finish the step in progress, then schedule normally."""
        burst = w.burst
        j = bisect.bisect_left(burst.ends, now)
        if j >= len(burst.ends) - 1:
            return  # it joins when the burst ends anyway
        w.engine.commit_burst(burst, j + 1)  # no request finishes before the burst's last step
        w.burst = None
        w.version += 1
        w.starting = True
        push(burst.ends[j], w, START)

    def dispatch(d: Dispatch, now: float) -> None:
        item = d.item
        r = item.request
        tkey = item.hash_space
        ceil_tok = ceiling.hit_tokens(tkey, r.hash_ids, r.input_tokens, item.trace.block_size)
        out_tokens = max(1, r.output_tokens)
        if r.input_tokens + out_tokens > max_len or r.input_tokens < 1:
            error = "context_overflow" if r.input_tokens >= 1 else "empty_prompt"
            records.append(
                record_for(
                    item,
                    d.due,
                    sent=d.due,
                    end=now,
                    e2e=now - d.due,
                    expected_output_tokens=out_tokens,
                    ceiling_tokens=ceil_tok,
                    ok=False,
                    error=error,
                )
            )
            plan.complete(item.id, now, False)
            return
        key_array = chain_keys(tkey, r.hash_ids, item.trace.block_size, bs, r.input_tokens)
        keys = key_array.tolist()
        i = policy.choose(RouteRequest(keys, r.input_tokens, item.tree_key, bs), workers)
        w = workers[i]
        rid = str(item.id)
        w.engine.add_request(
            rid,
            max_tokens=out_tokens,
            prompt_len=r.input_tokens,
            block_hashes=keys,
            session_id=item.tree_key,
            arrival=now,
            hash_array=key_array,
        )
        dispatched[rid] = (d, i, ceil_tok)
        if w.burst is not None:
            cut_burst(w, now)
        elif w.idle():
            start_step(w, now)

    plan.start(0.0)
    done = 0
    while True:
        due = plan.next_due()
        if ends and (due is None or ends[0][0] <= due):
            now, _, wi, version, kind = heapq.heappop(ends)
            w = workers[wi]
            if version == w.version:
                on_event(w, now, kind)
        elif due is None:
            break
        elif cfg.duration is not None and due > cfg.duration:
            plan.stop()
            continue
        else:
            now = due
            for d in plan.pop_due(due):
                dispatch(d, now)
        while now >= next_sample:
            timeline.append(_sample(next_sample, plan, workers))
            next_sample += cfg.sample_every
        if progress is not None and len(records) != done:
            done = len(records)
            progress(done, total)
    sim_s = max((r.end for r in records), default=0.0)
    summary = _summarize(records, cfg, ecfg, workers, timeline, itl, notes)
    return SimResult(records, summary, time.perf_counter() - wall0, sim_s)


def _record(d: Dispatch, req, worker: int, ceil_tok: int) -> RequestRecord:
    item = d.item
    ft, end = req.first_token, req.finished_at
    cached = {"GPU": req.num_cached_tokens, **req.lower_tier_tokens}
    return record_for(
        item,
        d.due,
        worker=str(worker),
        sent=d.due,
        first_token=ft,
        end=end,
        ttft=ft - d.due,
        e2e=end - d.due,
        tpot=(end - ft) / (req.num_output - 1) if req.num_output > 1 else None,
        itl_max=req.itl_max if req.num_output > 1 else None,
        input_tokens=req.prompt_len,
        output_tokens=req.num_output,
        expected_output_tokens=req.max_tokens,
        cached_tokens=req.num_cached_tokens + sum(req.lower_tier_tokens.values()),
        cached_by_tier=cached,
        ceiling_tokens=ceil_tok,
        queue_s=(req.first_scheduled - req.arrival) if req.first_scheduled else None,
        preemptions=req.num_preemptions,
    )


def _sample(t: float, plan: ReplayPlan, workers: list[SimWorker]) -> Sample:
    usage = sum(w.engine.kv_usage for w in workers) / len(workers)
    return Sample(
        t,
        plan.in_flight,
        usage,
        sum(w.engine.num_running for w in workers),
        sum(w.engine.num_waiting for w in workers),
    )


def _summarize(records, cfg: SimConfig, ecfg: EngineConfig, workers, timeline, itl, notes) -> Summary:
    queries = sum(w.engine.prefix_cache_queries for w in workers)
    hits = sum(w.engine.prefix_cache_hits for w in workers)
    ok_in = sum(r.input_tokens for r in records if r.ok) or 1
    by_tier: dict[str, float] = {}
    for r in records:
        for tier, n in r.cached_by_tier.items():
            by_tier[tier] = by_tier.get(tier, 0) + n
    by_tier = {k: v / ok_in for k, v in by_tier.items()}
    gpu = get_gpu(ecfg.gpu)
    config = {
        "engine": asdict(ecfg),
        "workers": cfg.workers,
        "lanes": cfg.lanes,
        "router": cfg.router,
        "kv_weight": cfg.kv_weight if cfg.router == "kv_aware" else None,
        "seed": cfg.seed,
        "warm_start": cfg.warm_start,
        "idle_gap_cap": cfg.idle_gap_cap,
        "max_requests": cfg.max_requests,
        "duration": cfg.duration,
        "num_gpu_blocks": workers[0].engine.num_gpu_blocks,
    }
    target = f"simulated {cfg.workers}x {gpu.name} (tp={ecfg.tensor_parallel_size}) {ecfg.model}"
    return summarize(
        records,
        kind="simulate",
        target=target,
        config=config,
        itl_values=itl,
        metrics_hit_rate=hits / queries if queries else None,
        timeline=timeline,
        gpus=cfg.workers * ecfg.tensor_parallel_size,
        power_w=gpu.power_w,
        preemptions=sum(w.engine.scheduler.num_preemptions for w in workers),
        by_tier=by_tier,
        notes=notes,
    )
