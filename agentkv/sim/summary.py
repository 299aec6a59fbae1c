"""What a simulated run reports: per-request records, timeline samples and the summary."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from agentkv.engine.config import EngineConfig
from agentkv.engine.hardware import get_gpu
from agentkv.metrics.records import RequestRecord, record_for
from agentkv.metrics.summary import LATENCY_FIGURES, Sample, Summary, summarize
from agentkv.trace.plan import Dispatch, ReplayPlan

if TYPE_CHECKING:
    from agentkv.sim.cluster import SimConfig
    from agentkv.sim.worker import SimWorker


class SimSettings(msgspec.Struct, kw_only=True):
    """What summary.json's `config` records of a simulated run."""

    engine: EngineConfig
    workers: int
    lanes: int | None  # with session_rate a cap on trees at once (None: none)
    session_rate: float | None = None
    arrivals: str | None = None
    router: str
    kv_weight: float | None  # kv_aware only
    seed: int
    warm_start: bool
    idle_gap_cap: float | None
    max_requests: int | None
    duration: float | None
    num_gpu_blocks: int


def finished_record(d: Dispatch, req, worker: int, ceil_tok: int) -> RequestRecord:
    """The record of a request that ran to its end on simulated `worker`."""
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


def sample(t: float, plan: ReplayPlan, workers: list[SimWorker]) -> Sample:
    """The cluster at time `t`: requests in flight, mean KV usage, running and waiting."""
    usage = sum(w.engine.kv_usage for w in workers) / len(workers)
    return Sample(
        t,
        plan.in_flight,
        usage,
        sum(w.engine.num_running for w in workers),
        sum(w.engine.num_waiting for w in workers),
    )


def sim_summary(records, cfg: SimConfig, ecfg: EngineConfig, workers, timeline, itl, notes) -> Summary:
    """The summary of a run: the records' figures, the engines' counters and the settings."""
    queries = sum(w.engine.prefix_cache_queries for w in workers)
    hits = sum(w.engine.prefix_cache_hits for w in workers)
    ok_in = sum(r.input_tokens for r in records if r.ok) or 1
    by_tier: dict[str, float] = {}
    for r in records:
        for tier, n in r.cached_by_tier.items():
            by_tier[tier] = by_tier.get(tier, 0) + n
    by_tier = {k: v / ok_in for k, v in by_tier.items()}
    gpu = get_gpu(ecfg.gpu)
    config = SimSettings(
        engine=ecfg,
        workers=cfg.workers,
        lanes=cfg.lanes,
        session_rate=cfg.session_rate,
        arrivals=cfg.arrivals if cfg.session_rate else None,
        router=cfg.router,
        kv_weight=cfg.kv_weight if cfg.router == "kv_aware" else None,
        seed=cfg.seed,
        warm_start=cfg.warm_start,
        idle_gap_cap=cfg.idle_gap_cap,
        max_requests=cfg.max_requests,
        duration=cfg.duration,
        num_gpu_blocks=workers[0].engine.num_gpu_blocks,
    )
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
        preemptions=sum(w.engine.num_preemptions for w in workers),
        by_tier=by_tier,
        notes=notes,
        clocks={**dict.fromkeys(LATENCY_FIGURES, "virtual"), "duration": "virtual"},
    )
