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
from dataclasses import dataclass, field, replace
from enum import IntEnum
from typing import NamedTuple

import numpy as np

from agentkv.engine.config import EngineConfig
from agentkv.engine.engine import Engine, StepResult
from agentkv.engine.hardware import get_system
from agentkv.errors import UserError
from agentkv.metrics.records import RequestRecord, record_for
from agentkv.metrics.summary import Sample, Summary
from agentkv.placement import KV_QUEUE_CAP, KV_QUEUE_WEIGHT, KV_WEIGHT, POLICIES, check_kv_weights
from agentkv.placement.policy import RouteRequest, make_policy
from agentkv.sim.deploy import check_pools, kv_weights
from agentkv.sim.limits import engine_config, reject_reason
from agentkv.sim.summary import finished_record, sample, sim_summary
from agentkv.sim.worker import SimWorker
from agentkv.trace.blocks import KeyChain, key_chain
from agentkv.trace.ceiling import CeilingTracker
from agentkv.trace.model import Trace
from agentkv.trace.plan import Dispatch, PlanItem, ReplayPlan
from agentkv.trace.warmup import check_load, is_warmup


@dataclass(slots=True)
class SimConfig:
    """A simulated cluster: one engine config for every worker, the router and the replay plan."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    workers: int = 1
    lanes: int | None = 16  # closed loop: trees at once; with session_rate a cap (None: none)
    router: str = "kv_aware"
    kv_weight: float = KV_WEIGHT  # kv_aware only
    kv_queue_weight: float = KV_QUEUE_WEIGHT  # kv_aware: price of active prefill (Dynamo's: 1)
    kv_queue_cap: float = KV_QUEUE_CAP  # kv_aware: active prefill counted up to this x the request's blocks
    seed: int = 0
    warm_start: bool = False
    idle_gap_cap: float | None = 10.0
    max_requests: int | None = None
    duration: float | None = None  # simulated seconds after which no new request is released
    session_rate: float | None = None  # open loop: new session trees per simulated second
    arrivals: str = "poisson"  # poisson | constant spacing of those arrivals (seeded by seed)
    sample_every: float = 1.0  # simulated seconds between timeline samples
    # run pure-decode stretches as one event, and defer quiet decodes beside a long prefill
    # (`Engine.defer_decodes`): the same records, far fewer events and per-request updates
    bursts: bool = True
    # deployment (sim/disagg.py): a catalogue system; prefill/decode pools when prefill_workers > 0
    system: str | None = None
    prefill_workers: int = 0
    decode_workers: int = 0
    prefill_tensor_parallel_size: int | None = None  # None: --tensor-parallel-size
    decode_tensor_parallel_size: int | None = None
    prefill_data_parallel_size: int | None = None  # None: --data-parallel-size (a pool's DP ranks
    decode_data_parallel_size: int | None = None  # share its expert group: wide EP)
    prefill_enable_expert_parallel: bool | None = None  # None: --enable-expert-parallel
    decode_enable_expert_parallel: bool | None = None
    decode_router: str = "least_loaded"
    decode_kv_weight: float | None = None  # --decode-router kv_aware's prices (None: kv_weight,
    decode_kv_queue_weight: float | None = None  # kv_queue_weight: both pools share them)
    kv_link_gbps: float | None = None  # override both links' GB/s per GPU (inf: free transfers)
    tier_tps: float = 20.0  # interactivity tier: output tok/s per user (p50) at least this ...
    tier_ttft_p90: float = 10.0  # ... and TTFT p90 at most this many seconds
    cycle: bool = False  # refill the trace queue so no lane runs dry (needs duration or max_requests)
    think_scale: float = 1.0  # think/tool gaps between turns x this (latencies are not scaled)
    warmup_requests: int = 0  # the first N released requests warm the cache, left out of every figure
    warmup_s: float = 0.0  # ... or those due in the first S simulated seconds

    def __post_init__(self) -> None:
        if self.workers < 1 or (self.lanes is not None and self.lanes < 1):
            raise UserError("--workers and --lanes must be >= 1")
        _check_deployment(self)
        check_load(self)
        check_kv_weights(self.kv_weight, self.kv_queue_weight, queue_cap=self.kv_queue_cap)
        if self.router not in POLICIES:
            raise UserError(f"--router: '{self.router}' is not one of {', '.join(POLICIES)}")


def _check_deployment(cfg: SimConfig) -> None:
    """The deployment settings' one-line errors (the system name is checked where it is read)."""
    if cfg.prefill_workers < 0 or cfg.decode_workers < 0:
        raise UserError("--disagg: prefill and decode worker counts must be >= 0")
    if (cfg.prefill_workers > 0) != (cfg.decode_workers > 0):
        raise UserError("--disagg needs both pools: prefill=N,decode=M with N, M >= 1")
    check_pools(cfg)
    if cfg.decode_router not in POLICIES:
        raise UserError(f"--decode-router: '{cfg.decode_router}' is not one of {', '.join(POLICIES)}")
    if cfg.kv_link_gbps is not None and not cfg.kv_link_gbps > 0:
        raise UserError(f"--kv-link-gbps must be > 0 (inf: free transfers), got {cfg.kv_link_gbps}")
    if not (cfg.tier_tps >= 0 and cfg.tier_ttft_p90 > 0):
        raise UserError("--tier: tps must be >= 0 and ttft_p90 > 0")
    if cfg.cycle and cfg.duration is None and cfg.max_requests is None:
        raise UserError("--cycle replays the traces without end: add --duration or --max-requests")
    if cfg.system is not None:  # the system names the GPU (it overrides --gpu)
        cfg.engine = replace(cfg.engine, gpu=get_system(cfg.system).gpu)


class EventKind(IntEnum):
    """What happens at a worker's event: its step ends, its decode burst ends, it may start, or a
    request's KV arrives from a prefill worker (disaggregated runs)."""

    STEP_END = 0
    BURST_END = 1
    START = 2  # after a burst was cut short: schedule normally from here
    KV_ARRIVED = 3


class Event(NamedTuple):
    """One worker event; ordered by time, then by when it was pushed (ties keep FIFO order)."""

    time: float
    seq: int
    worker: int
    version: int  # the worker's version when pushed: a cut burst's end event is stale (-1: never)
    kind: EventKind


class SimResult:
    def __init__(self, records: list[RequestRecord], summary: Summary, wall_s: float, sim_s: float):
        self.records, self.summary, self.wall_s, self.sim_s = records, summary, wall_s, sim_s


class Cluster:
    """N simulated engines behind one placement policy, driven by the replay plan: `run()` once."""

    def __init__(
        self, traces: Sequence[Trace], cfg: SimConfig, progress: Callable[[int, int], None] | None = None
    ):
        self.cfg, self.progress = cfg, progress
        self.notes: list[str] = []
        self.ecfg = engine_config(traces, cfg.engine, self.notes)
        self.itl: list[float] = []
        self.workers = self._make_workers()
        self.policy = make_policy(cfg.router, seed=cfg.seed, **kv_weights(cfg, "router"))
        for w in self.workers:  # the queue lookup only where the policy reads it
            w.track_prefill = self.policy.queue_weight > 0
            w.engine.defer_decodes = cfg.bursts  # (the same records: an optimisation, as bursts are)
        self.plan = ReplayPlan(
            traces,
            lanes=cfg.lanes,
            seed=cfg.seed,
            session_rate=cfg.session_rate,
            arrivals=cfg.arrivals,
            warm_start=cfg.warm_start,
            idle_gap_cap=cfg.idle_gap_cap,
            max_requests=cfg.max_requests,
            cycle=cfg.cycle,
            time_scale=cfg.think_scale,
        )
        self.total = cfg.max_requests or sum(t.num_requests for t in traces)
        self.ceiling = CeilingTracker()
        self.records: list[RequestRecord] = []
        self.dispatched: dict[
            str, tuple[Dispatch, int, int]
        ] = {}  # request id -> (dispatch, worker, ceiling)
        self.events: list[Event] = []
        self.timeline: list[Sample] = []
        self.tree_samples = [0, 0]  # (sum of active session trees, samples): their time-mean
        self._seq = 0
        # session -> its latest request's block keys (chain, list): the next turn resumes the chain
        # and reuses the list's ints where they agree (`_prepare`, `_key_list`); dropped with the
        # session's last request
        self._turn_keys: dict[str, tuple[KeyChain, list[int]]] = {}
        self._max_len = min(w.engine.max_model_len for w in self.workers)
        self._kv_len = min(w.engine.max_seq_tokens for w in self.workers)  # more never fits the KV

    def _make_workers(self) -> list[SimWorker]:
        return [SimWorker(i, Engine(self.ecfg, itl_sink=self.itl)) for i in range(self.cfg.workers)]

    def _summary(self) -> Summary:
        cfg, workers = self.cfg, self.workers
        return sim_summary(
            self.records, cfg, self.ecfg, workers, self.timeline, self.itl, self.notes, trees=self.mean_trees
        )

    @property
    def mean_trees(self) -> float | None:
        """Session trees in progress, averaged over the run's timeline samples (None: no sample)."""
        total, n = self.tree_samples
        return total / n if n else None

    def run(self) -> SimResult:
        """Replay every due request and every worker event in time order; the records and summary."""
        wall0 = time.perf_counter()
        plan, events, workers, cfg = self.plan, self.events, self.workers, self.cfg
        next_sample, done = 0.0, 0
        plan.start(0.0)
        while True:
            due = plan.next_due()
            if events and (due is None or events[0].time <= due):
                ev = heapq.heappop(events)
                now, w = ev.time, workers[ev.worker]
                if ev.version == w.version or ev.version < 0:
                    self._on_event(w, now, ev.kind, ev.seq)
            elif due is None:
                break
            elif cfg.duration is not None and due > cfg.duration:
                plan.stop()
                continue
            else:
                now = due
                for d in plan.pop_due(due):
                    self._dispatch(d, now)
            if now >= next_sample:  # every sample up to now sees the same state: taken once
                s, trees = sample(next_sample, plan, workers), plan.active_trees
                while now >= next_sample:
                    self.timeline.append(Sample(next_sample, s.in_flight, s.kv_usage, s.running, s.waiting))
                    self.tree_samples[0] += trees
                    self.tree_samples[1] += 1
                    next_sample += cfg.sample_every
            if self.progress is not None and len(self.records) != done:
                done = len(self.records)
                self.progress(done, self.total)
        sim_s = max((r.end for r in self.records), default=0.0)
        summary = self._summary()
        if plan.in_flight:  # nothing left to step, yet requests never ended: report, never hide
            why = f"{plan.in_flight:,} released requests never finished (the simulation stalled with them queued)"
            summary.notes.append(why)
            summary.valid = False
            summary.invalid_reasons.append(why)
            summary.invalid_reason = "; ".join(summary.invalid_reasons)
        return SimResult(self.records, summary, time.perf_counter() - wall0, sim_s)

    def _push(self, t: float, w: SimWorker, kind: EventKind, version: int | None = None) -> int:
        """Queue an event for `w` at `t` (stale once `w.version` moves on, unless `version` is -1)."""
        seq = self._seq
        heapq.heappush(self.events, Event(t, seq, w.index, w.version if version is None else version, kind))
        self._seq += 1
        return seq

    def _start_step(self, w: SimWorker, now: float) -> None:
        """Start the worker's next step (or decode burst) at `now`, if it has work."""
        eng = w.engine
        eng.clock.advance_to(now)
        w.starting = False
        burst = eng.plan_burst() if self.cfg.bursts else None
        if burst is not None:
            w.burst = burst
            self._push(burst.ends[-1], w, EventKind.BURST_END)
            return
        res = eng.step()
        w.pending = res
        if res is not None:
            self._push(res.end, w, EventKind.STEP_END)

    def _deliver(self, w: SimWorker, res: StepResult, now: float) -> None:
        """Record the requests a step finished and tell the plan (their sessions may go on)."""
        for out in res.outputs:
            if not out.finished:
                continue
            req = out.request
            d, wi, ceil_tok = self.dispatched.pop(req.request_id)
            self.records.append(finished_record(d, req, wi, ceil_tok))
            self.plan.complete(d.item.id, now, True)

    def _on_event(self, w: SimWorker, now: float, kind: EventKind, seq: int) -> None:
        if kind == EventKind.KV_ARRIVED:
            self._kv_arrived(w, now, seq)
            return
        if kind == EventKind.STEP_END:
            res, w.pending = w.pending, None
        elif kind == EventKind.BURST_END:
            burst, w.burst = w.burst, None
            res = w.engine.commit_burst(burst, len(burst.ends))
        else:
            res = None
        if res is not None:
            self._deliver(w, res, now)
        self._start_step(w, now)

    def _kv_arrived(self, w: SimWorker, now: float, seq: int) -> None:
        raise RuntimeError("KV_ARRIVED in an aggregated run")  # only disaggregated runs push it

    def _wake(self, w: SimWorker, now: float) -> None:
        """A request was queued on `w`: cut its decode burst short, or start it if it was idle."""
        if w.burst is not None:
            self._cut_burst(w, now)
        elif w.idle():
            self._start_step(w, now)

    def _cut_burst(self, w: SimWorker, now: float) -> None:
        """A request joins a worker mid-burst: finish the step in progress, then schedule normally."""
        burst = w.burst
        j = bisect.bisect_left(burst.ends, now)
        if j >= len(burst.ends) - 1:
            return  # it joins when the burst ends anyway
        w.engine.commit_burst(burst, j + 1)  # no request finishes before the burst's last step
        w.burst = None
        w.version += 1
        w.starting = True
        self._push(burst.ends[j], w, EventKind.START)

    def _reject(self, d: Dispatch, now: float, out_tokens: int, ceil_tok: int) -> None:
        """A request no engine can take (longer than max_model_len or its KV, or empty): failed."""
        r = d.item.request
        error = reject_reason(r.input_tokens, out_tokens, self._max_len, self._kv_len, self.notes)
        self.records.append(
            record_for(
                d.item,
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
        self.plan.complete(d.item.id, now, False)

    def _prepare(self, d: Dispatch, now: float):
        """(block keys as a `KeyChain`, ceiling tokens, output tokens) of a due request, or None when no
        engine can take it (recorded as failed). The chain resumes its session's previous request's
        where their ids agree (`key_chain`): a turn re-sends its session's context."""
        item = d.item
        r = item.request
        space = item.hash_space
        ids = np.asarray(r.hash_ids, dtype=np.int64)  # (trace ids fit in int64: formats/limits.py)
        ceil_tok = self.ceiling.hit_tokens(space, ids, r.input_tokens, item.trace.block_size)
        out_tokens = max(1, r.output_tokens)
        if r.input_tokens + out_tokens > min(self._max_len, self._kv_len) or r.input_tokens < 1:
            self._reject(d, now, out_tokens, ceil_tok)
            self._file_turn(item, None)
            return None
        bs = self.ecfg.block_size
        last = self._turn_keys.get(item.session_key)
        chain = key_chain(space, ids, item.trace.block_size, bs, r.input_tokens, last and last[0])
        return chain, ceil_tok, out_tokens

    def _route(self, d: Dispatch, chain: KeyChain) -> RouteRequest:
        """What placement sees of a request: its block keys, length, session tree, block size."""
        item = d.item
        keys = self._key_list(item, chain)
        return RouteRequest(keys, item.request.input_tokens, item.tree_key, self.ecfg.block_size)

    def _key_list(self, item: PlanItem, chain: KeyChain) -> list[int]:
        """`chain.keys.tolist()`, made from the session's previous request's list for the keys the
        chain took from that request's (`_prepare` resumed it from the same entry) and converted only
        past them: a turn re-sends its session's context, and converting every key to a Python int
        cost ~10% of a run."""
        keys, k = chain.keys, chain.resumed
        if k:  # (the shared prefix's references; the rest extends it)
            out = self._turn_keys[item.session_key][1][:k]
            out += keys[k:].tolist()
        else:
            out = keys.tolist()
        self._file_turn(item, (chain, out))
        return out

    def _file_turn(self, item: PlanItem, keys: tuple[KeyChain, list[int]] | None) -> None:
        """A request of its session dispatched with these keys (None: refused, and the session's
        earlier keys stay for its next turn): kept for the next turn, and the session's entry dropped
        with its last request, dispatched or refused."""
        if item.index + 1 >= len(item.session.requests):
            self._turn_keys.pop(item.session_key, None)
        elif keys is not None:
            self._turn_keys[item.session_key] = keys

    def _queue(
        self,
        w: SimWorker,
        d: Dispatch,
        now: float,
        route: RouteRequest,
        key_array,
        max_tokens: int,
        ext: int = 0,
    ):
        """Add the request to `w`'s engine (`ext` prompt tokens' KV already there) and wake `w`."""
        item = d.item
        req = w.add_request(
            str(item.id),
            max_tokens=max_tokens,
            prompt_len=item.request.input_tokens,
            block_hashes=route.block_hashes,
            session_id=item.tree_key,
            arrival=now,
            hash_array=key_array,
            external_tokens=ext,
        )
        req.measured = not is_warmup(self.cfg, item.id, d.due)
        self._wake(w, now)
        return req

    def _placed(self, d: Dispatch, now: float, workers: Sequence[SimWorker]):
        """(worker index in `workers`, route, key array, ceiling, output tokens) of a due request by
        the placement policy; None when no engine can take it (recorded as failed)."""
        prep = self._prepare(d, now)
        if prep is None:
            return None
        chain, ceil_tok, out_tokens = prep
        route = self._route(d, chain)
        return self.policy.choose(route, workers), route, chain.keys, ceil_tok, out_tokens

    def _dispatch(self, d: Dispatch, now: float) -> None:
        """Route a due request to a worker and queue it there (or record why it cannot run)."""
        placed = self._placed(d, now, self.workers)
        if placed is None:
            return
        i, route, key_array, ceil_tok, out_tokens = placed
        self.dispatched[str(d.item.id)] = (d, i, ceil_tok)
        self._queue(self.workers[i], d, now, route, key_array, out_tokens)


def simulate(
    traces: Sequence[Trace], cfg: SimConfig, progress: Callable[[int, int], None] | None = None
) -> SimResult:
    """Replay `traces` on the cluster `cfg` describes (`make_cluster`): records and the summary."""
    return make_cluster(traces, cfg, progress).run()


def make_cluster(
    traces: Sequence[Trace], cfg: SimConfig, progress: Callable[[int, int], None] | None = None
) -> Cluster:
    """The cluster `cfg` describes: prefill and decode pools when `cfg.prefill_workers` > 0."""
    if cfg.prefill_workers > 0:
        from agentkv.sim.disagg import DisaggCluster

        return DisaggCluster(traces, cfg, progress)
    return Cluster(traces, cfg, progress)
