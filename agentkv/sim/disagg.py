"""Prefill/decode disaggregation (Dynamo, llm-d style) on the simulated cluster.

Two pools of engines, each with its own tensor parallelism and KV capacity. A due request is routed
to a prefill worker by the cluster's placement policy (its prefix cache counts there) and runs there
with max_tokens=1. When its prefill ends, a decode worker is picked (`decode_router`: least_loaded,
session, ...; kv_aware prices with --decode-kv-weight and --decode-kv-queue-weight, by default the
prefill pool's --kv-weight and --kv-queue-weight; Dynamo's decode stage uses overlap weight 0); the
prompt KV that worker does not already cache moves over NVLink when both sit in one NVLink domain,
else over RDMA, priced by the link model per copy of one layer's block. The decode worker admits
the request only when the KV has arrived (a KV_ARRIVED event), as externally loaded KV: allocated,
not computed; it recomputes the last prompt token and emits the first output token, as vLLM's
disaggregated decode does. Transfers to or from one worker queue behind each other.
Simplifications: the prefill worker frees the blocks at once (vLLM holds them until the pull), and
a decode worker's own cache is read when the transfer starts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from agentkv.engine.engine import Engine, StepResult
from agentkv.engine.kv_move import kv_transfer_seconds
from agentkv.metrics.summary import DisaggStats, Dist, Summary
from agentkv.placement.policy import RouteRequest, make_policy
from agentkv.sim.cluster import Cluster, EventKind, SimConfig
from agentkv.sim.deploy import deployment, kv_links, kv_weights, pool_engine, pool_tp
from agentkv.sim.summary import finished_record, pool_hit_rate, sim_summary
from agentkv.sim.worker import SimWorker
from agentkv.trace.model import Trace
from agentkv.trace.plan import Dispatch


class _Flight:
    """A request between its pools: what it needs for the decode side and its record."""

    __slots__ = (
        "d",
        "ceil",
        "out_tokens",
        "route",
        "key_array",
        "prefill",
        "p",
        "decode",
        "kv_sent",
        "kv_at",
    )

    def __init__(self, d: Dispatch, ceil: int, out_tokens: int, route: RouteRequest, key_array: np.ndarray):
        self.d, self.ceil, self.out_tokens, self.route, self.key_array = d, ceil, out_tokens, route, key_array
        self.prefill = None  # the prefill-side EngineRequest
        self.p = self.decode = -1  # worker indices (decode: into the whole worker list)
        self.kv_sent = self.kv_at = 0.0  # when its KV left the prefill worker, reached the decode one


class DisaggCluster(Cluster):
    """The cluster with `prefill_workers` prefill engines first, then `decode_workers` decode engines."""

    def __init__(
        self, traces: Sequence[Trace], cfg: SimConfig, progress: Callable[[int, int], None] | None = None
    ):
        super().__init__(traces, cfg, progress)
        if cfg.workers != 1:
            self.notes.append(
                f"--workers {cfg.workers} is not used with --disagg (its pools set the engines)"
            )
        self.dep = deployment(cfg)
        self.nvlink, self.rdma = kv_links(self.dep, cfg.kv_link_gbps)
        self.decode_policy = make_policy(cfg.decode_router, seed=cfg.seed + 1, **kv_weights(cfg, "decode"))
        p = self.decode_policy  # at weight 0 the queue term costs nothing: no lookups for it
        for w in self.decode_workers:
            w.track_prefill = p.queue_weight > 0 and getattr(p, "weight", 0.0) > 0
        self.flights: dict[str, _Flight] = {}
        self.arrivals: dict[int, str] = {}  # KV_ARRIVED event seq -> request id
        self.link_free = [0.0] * len(self.workers)  # when each worker's link is free again
        self.transfer_s: list[float] = []
        self.moved_bytes = 0.0
        self.n_nvlink = self.n_rdma = 0

    def _make_workers(self) -> list[SimWorker]:
        cfg = self.cfg
        tp_p, tp_d = pool_tp(cfg)
        pe, de = pool_engine(cfg, self.ecfg, "prefill"), pool_engine(cfg, self.ecfg, "decode")
        engines = [Engine(pe, itl_sink=self.itl) for _ in range(cfg.prefill_workers)]
        engines += [Engine(de, itl_sink=self.itl) for _ in range(cfg.decode_workers)]
        self.prefill_pool = engines[: cfg.prefill_workers]
        self.gpu_at = [i * tp_p for i in range(cfg.prefill_workers)]  # each worker's first GPU
        base = cfg.prefill_workers * tp_p
        self.gpu_at += [base + i * tp_d for i in range(cfg.decode_workers)]
        return [SimWorker(i, e) for i, e in enumerate(engines)]

    @property
    def decode_workers(self) -> list[SimWorker]:
        return self.workers[self.cfg.prefill_workers :]

    def _dispatch(self, d: Dispatch, now: float) -> None:
        """Route a due request to a prefill worker, to compute its prompt KV (one output token)."""
        placed = self._placed(d, now, self.workers[: self.cfg.prefill_workers])
        if placed is None:
            return
        i, route, key_array, ceil_tok, out_tokens = placed
        fl = self.flights[str(d.item.id)] = _Flight(d, ceil_tok, out_tokens, route, key_array)
        fl.p = i
        fl.prefill = self._queue(self.workers[i], d, now, route, key_array, 1)

    def _deliver(self, w: SimWorker, res: StepResult, now: float) -> None:
        """A prefill ends: start its KV transfer. A decode ends: record the request."""
        for out in res.outputs:
            if not out.finished:
                continue
            rid = out.request.request_id
            if w.index < self.cfg.prefill_workers:
                self._transfer(self.flights[rid], now)
                continue
            fl = self.flights.pop(rid)
            label = f"p{fl.p}/d{fl.decode - self.cfg.prefill_workers}"
            self.records.append(finished_record(fl.d, out.request, label, fl.ceil, prefill=fl.prefill))
            self.plan.complete(fl.d.item.id, now, True)

    def transfer_seconds(self, fl: _Flight, dw: SimWorker, start: int, end: int) -> float:
        """Seconds to move prompt tokens [start, end) of KV from `fl`'s prefill worker to `dw`, which
        caches the first `start` (bytes per layer group: `kv_transfer_bytes`): each decode rank receives
        its shard in copies of one layer's block; the pools' narrower TP bounds the links used at once.
        NVLink within one NVLink domain, else RDMA."""
        dom = self.dep.nvlink_domain
        same = self.gpu_at[fl.p] // dom == self.gpu_at[dw.index] // dom
        if same:
            self.n_nvlink += 1
        else:
            self.n_rdma += 1
        secs, moved = kv_transfer_seconds(
            dw.engine, start, end, pool_tp(self.cfg)[0], self.nvlink if same else self.rdma
        )
        self.moved_bytes += moved
        return secs

    def _transfer(self, fl: _Flight, now: float) -> None:
        """Pick the decode worker and queue the KV's arrival there."""
        item = fl.d.item
        j = self.cfg.prefill_workers + self.decode_policy.choose(fl.route, self.decode_workers)
        dw = self.workers[j]
        local = dw.engine.cached_prefix(fl.route.block_hashes)[0] * self.ecfg.block_size
        arrived = item.request.input_tokens - 1
        secs = self.transfer_seconds(fl, dw, local, arrived) if arrived > local else 0.0
        start = max(now, self.link_free[fl.p], self.link_free[j])
        end = start + secs
        if secs:
            self.link_free[fl.p] = self.link_free[j] = end
        self.transfer_s.append(end - now)
        fl.decode, fl.kv_sent, fl.kv_at = j, start, end
        self.arrivals[self._push(end, dw, EventKind.KV_ARRIVED, version=-1)] = str(item.id)

    def _kv_arrived(self, w: SimWorker, now: float, seq: int) -> None:
        """The KV is on the decode worker: queue the request there, its prompt but the last token loaded."""
        fl = self.flights[self.arrivals.pop(seq)]
        ext = fl.d.item.request.input_tokens - 1
        self._queue(w, fl.d, now, fl.route, fl.key_array, fl.out_tokens, ext)

    def _summary(self) -> Summary:
        p = self.cfg.prefill_workers
        stats = DisaggStats(
            prefill_workers=p,
            decode_workers=self.cfg.decode_workers,
            prefill_hit_rate=pool_hit_rate(self.workers[:p]),
            decode_hit_rate=pool_hit_rate(self.workers[p:]),
            kv_transfer_s=Dist.of(self.transfer_s),
            kv_transferred_gb=self.moved_bytes / 1e9,
            transfers_nvlink=self.n_nvlink,
            transfers_rdma=self.n_rdma,
        )
        return sim_summary(
            self.records,
            self.cfg,
            self.ecfg,
            self.workers,
            self.timeline,
            self.itl,
            self.notes,
            stats,
            trees=self.mean_trees,
        )
