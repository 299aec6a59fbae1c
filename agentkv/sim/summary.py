"""What a simulated run reports: per-request records, timeline samples and the summary."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from agentkv.engine.config import EngineConfig
from agentkv.metrics.records import RequestRecord, record_for
from agentkv.metrics.summary import LATENCY_FIGURES, DisaggStats, Sample, Summary, summarize
from agentkv.metrics.tier import interactivity
from agentkv.sim.deploy import deployment, kv_weights, pool_engine, pool_label, pool_tp, total_gpus
from agentkv.trace.plan import Dispatch, ReplayPlan
from agentkv.trace.warmup import is_warmup, measured, warmup_label, warmup_notes

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
    kv_weight: float | None  # --kv-weight when either pool is kv_aware (else None)
    kv_queue_weight: float | None = None  # --kv-queue-weight likewise
    kv_queue_cap: float | str | None = None  # --kv-queue-cap likewise ("none": uncapped)
    seed: int
    warm_start: bool
    idle_gap_cap: float | None
    max_requests: int | None
    duration: float | None
    num_gpu_blocks: int
    system: str | None = None
    prefill_workers: int = 0  # > 0: disaggregated (then `workers` is not used)
    decode_workers: int = 0
    prefill_tensor_parallel_size: int | None = None
    decode_tensor_parallel_size: int | None = None
    prefill_data_parallel_size: int | None = None  # a pool's DP ranks (each engine one rank)
    decode_data_parallel_size: int | None = None
    prefill_enable_expert_parallel: bool | None = None
    decode_enable_expert_parallel: bool | None = None
    decode_router: str | None = None
    decode_kv_weight: float | None = None  # the decode pool's kv_aware prices (--decode-kv-weight,
    decode_kv_queue_weight: float | None = None  # default the shared ones); None: not kv_aware
    decode_num_gpu_blocks: int | None = None
    kv_link_gbps: float | None = None
    gpus: int = 0
    power_w_per_gpu: float | None = None  # what the per-MW figures divide by
    power_basis: str = ""
    think_scale: float = 1.0
    cycle: bool = False  # the traces replayed again as lanes drain (--cycle)
    warmup: str | None = None  # "100 requests" or "30s": left out of every figure


def finished_record(d: Dispatch, req, worker: int | str, ceil_tok: int, prefill=None) -> RequestRecord:
    """The record of a request that ran to its end on simulated `worker`; in a disaggregated run
    `prefill` is its prefill-side request, whose cache hits and queueing the record reports."""
    item = d.item
    ft, end = req.first_token, req.finished_at
    first = prefill or req
    cached = {"GPU": first.num_cached_tokens, **first.lower_tier_tokens}
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
        cached_tokens=sum(cached.values()),
        cached_by_tier=cached,
        ceiling_tokens=ceil_tok,
        queue_s=(first.first_scheduled - first.arrival) if first.first_scheduled else None,
        preemptions=req.num_preemptions,
    )


def sample(t: float, plan: ReplayPlan, workers: list[SimWorker]) -> Sample:
    """The cluster at time `t`: requests in flight, mean KV usage, running and waiting."""
    usage, running, waiting = 0, 0, 0
    for w in workers:  # one pass (a sample per simulated second adds up on long runs)
        e = w.engine
        usage += e.kv_usage
        sched = e.scheduler  # `num_running`, `num_waiting` without their property calls
        running += len(sched.running)
        waiting += len(sched.waiting)
    return Sample(t, plan.in_flight, usage / len(workers), running, waiting)


def pool_hit_rate(workers) -> float | None:
    queries = sum(w.engine.prefix_cache_queries for w in workers)
    return sum(w.engine.prefix_cache_hits for w in workers) / queries if queries else None


def _measured(records, cfg: SimConfig, workers) -> tuple[list[RequestRecord], float | None, int]:
    """(the measured records, the engines' prefix-cache hit rate, preemptions): with a warm-up its
    records are marked and left out, and the engines' counters (which count it) give way to the
    records' own preemptions and no server-side hit rate."""
    pools = cfg.prefill_workers > 0
    if not (cfg.warmup_requests or cfg.warmup_s):
        hits = pool_hit_rate(workers[: cfg.prefill_workers] if pools else workers)
        return records, hits, sum(w.engine.num_preemptions for w in workers)
    for r in records:
        r.warmup = is_warmup(cfg, r.id, r.scheduled)
    kept = measured(records)
    return kept, None, sum(r.preemptions for r in kept)


def _pool_settings(cfg: SimConfig, ecfg: EngineConfig) -> dict:
    """Each pool's DP ranks and EP as its engines run them (own flag, else the global one)."""
    out = {}
    for pool in ("prefill", "decode"):
        e = pool_engine(cfg, ecfg, pool)
        out[f"{pool}_data_parallel_size"] = e.data_parallel_size
        out[f"{pool}_enable_expert_parallel"] = e.enable_expert_parallel
    return out


def _settings(cfg: SimConfig, ecfg: EngineConfig, workers, dep) -> SimSettings:
    """The run's settings as summary.json's `config` records them (pools and power included)."""
    tp_p, tp_d = pool_tp(cfg)
    pools = cfg.prefill_workers > 0
    gpus = total_gpus(cfg)
    dkv = kv_weights(cfg, "decode") if pools else {}
    kv_aware = cfg.router == "kv_aware" or bool(dkv)  # either pool's: the shared flags are read
    return SimSettings(
        engine=ecfg,
        workers=cfg.workers,
        lanes=cfg.lanes,
        session_rate=cfg.session_rate,
        arrivals=cfg.arrivals if cfg.session_rate else None,
        router=cfg.router,
        kv_weight=cfg.kv_weight if kv_aware else None,
        kv_queue_weight=cfg.kv_queue_weight if kv_aware else None,
        kv_queue_cap=(cfg.kv_queue_cap if cfg.kv_queue_cap < float("inf") else "none") if kv_aware else None,
        seed=cfg.seed,
        warm_start=cfg.warm_start,
        idle_gap_cap=cfg.idle_gap_cap,
        max_requests=cfg.max_requests,
        duration=cfg.duration,
        num_gpu_blocks=workers[0].engine.num_gpu_blocks,
        system=dep.system.name if dep.system else None,
        prefill_workers=cfg.prefill_workers,
        decode_workers=cfg.decode_workers,
        prefill_tensor_parallel_size=tp_p if pools else None,
        decode_tensor_parallel_size=tp_d if pools else None,
        **(_pool_settings(cfg, ecfg) if pools else {}),
        decode_router=cfg.decode_router if pools else None,
        decode_kv_weight=dkv.get("weight"),
        decode_kv_queue_weight=dkv.get("queue_weight"),
        decode_num_gpu_blocks=workers[-1].engine.num_gpu_blocks if pools else None,
        kv_link_gbps=cfg.kv_link_gbps,
        gpus=gpus,
        power_w_per_gpu=dep.power_w_per_gpu,
        power_basis=dep.power_basis,
        think_scale=cfg.think_scale,
        cycle=cfg.cycle,
        warmup=warmup_label(cfg),
    )


def sim_summary(
    records,
    cfg: SimConfig,
    ecfg: EngineConfig,
    workers,
    timeline,
    itl,
    notes,
    disagg: DisaggStats | None = None,
    trees: float | None = None,
) -> Summary:
    """The summary of a run: the records' figures, the engines' counters, the settings, and the
    run against its interactivity tier; `disagg`: the pools of a disaggregated run (its prefill
    pool's engines come first in `workers` and give the reported prefix-cache hit rate). Warm-up
    records are marked here and left out."""
    all_records, (records, hit_rate, preempted) = records, _measured(records, cfg, workers)
    ok_in = sum(r.input_tokens for r in records if r.ok) or 1
    by_tier: dict[str, float] = {}
    for r in records:
        for tier, n in r.cached_by_tier.items():
            by_tier[tier] = by_tier.get(tier, 0) + n
    by_tier = {k: v / ok_in for k, v in by_tier.items()}
    dep = deployment(cfg)
    gpus = total_gpus(cfg)
    pools = cfg.prefill_workers > 0
    config = _settings(cfg, ecfg, workers, dep)
    shape = (
        f"{cfg.prefill_workers}x prefill ({pool_label(pool_engine(cfg, ecfg, 'prefill'))}) + "
        f"{cfg.decode_workers}x decode ({pool_label(pool_engine(cfg, ecfg, 'decode'))})"
        if pools
        else f"{cfg.workers}x (tp={ecfg.tensor_parallel_size})"
    )
    where = f" on {dep.system.name}" if dep.system else ""
    summary = summarize(
        records,
        kind="simulate",
        target=f"simulated {shape} {dep.gpu.name}{where} {ecfg.model}",
        config=config,
        itl_values=itl,
        metrics_hit_rate=hit_rate,
        timeline=timeline,
        gpus=gpus,
        power_w=dep.power_w_per_gpu,
        preemptions=preempted,
        by_tier=by_tier,
        notes=[*notes, *warmup_notes(cfg, len(all_records) - len(records), "simulated")],
        clocks={**dict.fromkeys(LATENCY_FIGURES, "virtual"), "duration": "virtual"},
    )
    summary.disagg = disagg
    summary.warmup_requests = len(all_records) - len(records)
    tier = (cfg.tier_tps, cfg.tier_ttft_p90)
    summary.interactivity = interactivity(
        summary, cfg.lanes, gpus, dep.power_w_per_gpu, tier, dep.power_basis, mean_trees=trees
    )
    return summary
