"""`agentkv compare RUN1 RUN2 [RUN3 ...]`: N run summaries (bench or simulate) against the first.

Each run is a summary.json file or a run folder (its requests.jsonl, when there, gives the noise
band and the request set). Every figure is marked better or worse than the baseline only beyond
its noise band: max(2% relative (1 point for hit rates), the 95% bootstrap interval of the
difference over requests, paired when both runs replayed the same requests). Settings are
aligned (bench's server info in simulate's vLLM names) and differences listed; a warning says
when runs replayed different request sets or different workload settings.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np

from agentkv.errors import UserError
from agentkv.metrics.records import RequestRecord, read_records
from agentkv.metrics.report_prediction import read_prediction
from agentkv.metrics.summary import Summary, read_summary
from agentkv.metrics.view import latency_clock

ENGINE_TIME = {"engine", "virtual"}  # the target's own clock and simulate's: comparable

FLOOR = 0.02  # relative: run-to-run jitter of a server below which nothing is called a change
FLOOR_PP = 0.01  # hit rates and fractions: one percentage point
RESAMPLES = 200
# settings that shape the request stream: when they differ, so do the requests replayed
WORKLOAD = (
    *("lanes", "session_rate", "arrivals", "think_scale", "warmup", "clients", "cycle", "seed"),
    *("warm_start", "idle_gap_cap", "max_requests", "duration", "traces"),
    *("selection.sample", "selection.traces_limit", "selection.max_context", "selection.over_context"),
    "selection.trace_block_size",
)
# bench records the server's /get_server_info (SGLang names); simulate, vLLM's: one name each
SERVER_NAMES = {
    "server.served_model_name": "engine.model",
    "server.gpu": "engine.gpu",
    "server.tp_size": "engine.tensor_parallel_size",
    "server.page_size": "engine.block_size",
    "server.context_length": "engine.max_model_len",
    "server.max_running_requests": "engine.max_num_seqs",
    "server.chunked_prefill_size": "engine.max_num_batched_tokens",
    "server.dp_size": "workers",
}


class Run(msgspec.Struct):
    """One run: its name (as given), summary and, when beside it, its per-request records."""

    name: str
    summary: Summary
    records: list[RequestRecord] | None = None
    prediction: dict | None = None  # prediction.json beside it (`agentkv predict RUN_DIR`)
    problems: list[str] = msgspec.field(default_factory=list)  # files beside it that could not be read


def load(path: str) -> Run:
    """A run from a summary.json path or a run folder (with its requests.jsonl and prediction.json
    when there)."""
    p = Path(path)
    if p.is_dir():
        p = p / "summary.json"
    if not p.is_file():
        raise UserError(f"{path}: no summary.json there (give a summary.json file or a run folder)")
    summary = read_summary(p)
    rec = p.parent / "requests.jsonl"
    records = read_records(rec) if p.name == "summary.json" and rec.is_file() else None
    run = Run(name=path, summary=summary, records=records)
    if p.name == "summary.json":
        try:
            run.prediction = read_prediction(p.parent)
        except UserError as e:
            run.problems.append(f"{e}; its prediction is not shown")
    return run


_Get = Callable[[Summary], float | None]
_Sample = Callable[[list[RequestRecord]], np.ndarray] | None  # per-request columns (n, k)
_Stat = Callable[[np.ndarray], np.ndarray] | None  # (B, n, k) -> (B,)


@dataclass(frozen=True, slots=True)
class Figure:
    """A compared figure: how to read it from a summary, which way is better, and (for the noise
    band) how to sample it per request and compute it over a resample."""

    name: str
    unit: str  # ms | s | % | tok/s | req/s | "" (a count)
    better: str | None  # "lower" | "higher" | None (neither: a property of the workload)
    get: _Get
    sample: _Sample = None
    stat: _Stat = None


def _column(field: str) -> _Sample:
    def sample(recs: list[RequestRecord]) -> np.ndarray:
        vals = [getattr(r, field) for r in recs]
        return np.asarray([[np.nan if v is None else v] for v in vals], dtype=float)

    return sample


_STATS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "mean": lambda x: np.nanmean(x[..., 0], axis=1),
    "p50": lambda x: np.nanpercentile(x[..., 0], 50, axis=1),
    "p90": lambda x: np.nanpercentile(x[..., 0], 90, axis=1),
    "p99": lambda x: np.nanpercentile(x[..., 0], 99, axis=1),
}


def _dist(field: str, bootstrap: bool = True) -> list[Figure]:
    def get(stat: str) -> _Get:
        return lambda s: (lambda v: None if v is None else v * 1000)(getattr(getattr(s, field), stat))

    sample = _column(field) if bootstrap else None
    return [
        Figure(f"{field.upper()} {st}", "ms", "lower", get(st), sample, _STATS[st] if bootstrap else None)
        for st in ("mean", "p50", "p90", "p99")
    ]


def _tp(attr: str) -> _Get:
    return lambda s: getattr(s.throughput, attr) if s.throughput else None


def _hits(recs: list[RequestRecord]) -> np.ndarray:
    return np.asarray([[r.cached_tokens or 0, r.input_tokens] for r in recs], dtype=float)


def _ratio(x: np.ndarray) -> np.ndarray:
    return x[..., 0].sum(axis=1) / np.maximum(x[..., 1].sum(axis=1), 1.0)


FIGURES: list[Figure] = [
    Figure("requests", "", None, lambda s: s.requests),
    Figure("succeeded", "", None, lambda s: s.succeeded),
    Figure("failed", "", "lower", lambda s: s.failed),
    Figure("duration", "s", None, lambda s: s.duration_s),
    Figure("input tokens", "", None, lambda s: s.input_tokens),
    Figure("output tokens", "", None, lambda s: s.output_tokens),
    Figure("input tok/s", "tok/s", "higher", _tp("input_tokens_per_s")),
    Figure("output tok/s", "tok/s", "higher", _tp("output_tokens_per_s")),
    Figure("output tok/s per GPU", "tok/s", "higher", _tp("output_tokens_per_s_per_gpu")),
    Figure("requests/s", "req/s", "higher", _tp("requests_per_s")),
    *_dist("ttft"),
    *_dist("tpot"),
    *_dist("itl", bootstrap=False),  # the summary's ITL is over every token gap, not in the records
    *_dist("e2e"),
    Figure("cache hit: reported", "%", "higher", lambda s: s.cache.reported, _hits, _ratio),
    Figure("cache hit: server metrics", "%", "higher", lambda s: s.cache.metrics),
    Figure("cache hit: ceiling", "%", None, lambda s: s.cache.ceiling),
    Figure("goodput", "%", "higher", lambda s: s.goodput.fraction if s.goodput else None),
    Figure("preemptions", "", "lower", lambda s: s.preemptions),
    Figure("sessions", "", None, lambda s: len(s.sessions)),
]


class Cell(msgspec.Struct, omit_defaults=True):
    """One run's figure against the baseline: value, difference, the noise band and the verdict."""

    value: float | None
    diff: float | None = None  # value - baseline
    rel: float | None = None  # diff / |baseline|
    band: float | None = None  # noise band: relative, or absolute points for "%" figures
    verdict: str = ""  # better | worse | same (within the band) | changed (no better direction) | ""


class Row(msgspec.Struct):
    name: str
    unit: str
    better: str | None
    cells: list[Cell]  # one per run; the first is the baseline


def request_key(r: RequestRecord) -> tuple[str, str, int]:
    """What identifies a replayed request across runs: trace, live session, position in it."""
    return (r.trace, r.session, r.index)


def request_sets(runs: list[Run]) -> list[str]:
    """Warnings when a run replayed other requests than the baseline (by request id when both have
    requests.jsonl, else by the per-session turn counts of the summaries)."""
    base, out = runs[0], []
    for run in runs[1:]:
        if base.records is not None and run.records is not None:
            a = {request_key(r) for r in base.records}
            b = {request_key(r) for r in run.records}
            if a != b:
                out.append(
                    f"{run.name} replayed a different request set than {base.name}: {len(b - a):,} "
                    f"requests only in {run.name}, {len(a - b):,} only in {base.name} "
                    f"({len(a & b):,} in both); figures over different requests compare loosely"
                )
            continue
        sa = sorted((x.trace, x.session, x.turns, x.sub_requests) for x in base.summary.sessions)
        sb = sorted((x.trace, x.session, x.turns, x.sub_requests) for x in run.summary.sessions)
        if sa != sb or base.summary.requests != run.summary.requests:
            out.append(
                f"{run.name} replayed a different request set than {base.name} "
                f"({run.summary.requests:,} vs {base.summary.requests:,} requests, sessions differ "
                "in count or turns; no requests.jsonl beside a summary to compare request by request)"
            )
    return out


def _aligned(x: np.ndarray, y: np.ndarray, ka: list, kb: list) -> tuple[np.ndarray, np.ndarray] | None:
    """x and y restricted to the requests both have, in one order (None when they share none)."""
    ib = {k: i for i, k in enumerate(kb)}
    pairs = [(i, ib[k]) for i, k in enumerate(ka) if k in ib]
    if len(pairs) < 2:
        return None
    ia, jb = (np.asarray(v) for v in zip(*pairs, strict=True))
    return x[ia], y[jb]


def _bootstrap(
    fig: Figure, a: list[RequestRecord], b: list[RequestRecord], paired: bool, rng
) -> float | None:
    """Half the 95% bootstrap interval of stat(b) - stat(a), resampling requests (the same ones in
    both runs when `paired`), over the succeeded requests; None when either has under 2."""
    a, b = [r for r in a if r.ok], [r for r in b if r.ok]
    x, y = fig.sample(a), fig.sample(b)  # type: ignore[misc]
    if paired and (both := _aligned(x, y, [request_key(r) for r in a], [request_key(r) for r in b])):
        x, y = both
    else:
        paired = False
    if len(x) < 2 or len(y) < 2:
        return None
    ia = rng.integers(0, len(x), (RESAMPLES, len(x)))
    ib = ia if paired else rng.integers(0, len(y), (RESAMPLES, len(y)))
    with np.errstate(all="ignore"):
        d = fig.stat(y[ib]) - fig.stat(x[ia])  # type: ignore[misc]
    d = d[np.isfinite(d)]
    if d.size < RESAMPLES // 2:
        return None
    lo, hi = np.percentile(d, [2.5, 97.5])
    return float(hi - lo) / 2


def _cell(fig: Figure, base: float | None, v: float | None, ci: float | None) -> Cell:
    """The value against the baseline, with its band and verdict."""
    if v is None or base is None:
        return Cell(v)
    diff = v - base
    rel = diff / abs(base) if base else None
    if fig.unit == "%":
        band = max(FLOOR_PP, ci or 0.0)
        moved = abs(diff) > band
    else:
        if fig.unit == "ms" and ci is not None:
            ci *= 1000  # the bootstrap ran on seconds
        band = max(FLOOR, (ci / abs(base)) if ci is not None and base else 0.0)
        moved = (abs(rel) > band) if rel is not None else diff != 0
        if fig.unit == "" and fig.better is not None:  # counts (failures, preemptions): any change
            moved, band = diff != 0, 0.0
    if not moved:
        verdict = "same"
    elif fig.better is None:
        verdict = "changed"
    else:
        verdict = "better" if (diff < 0) == (fig.better == "lower") else "worse"
    return Cell(v, diff, rel, band, verdict)


def compare(runs: list[Run], seed: int = 0) -> list[Row]:
    """Every figure of every run against the first run (the baseline)."""
    rng = np.random.default_rng(seed)
    base = runs[0]
    same_set = [
        base.records is not None
        and r.records is not None
        and {request_key(x) for x in base.records} == {request_key(x) for x in r.records}
        for r in runs
    ]
    rows = []
    for fig in FIGURES:
        vb = fig.get(base.summary)
        cells = [Cell(vb)]
        for i, run in enumerate(runs[1:], 1):
            ci = None
            if fig.sample is not None and base.records is not None and run.records is not None:
                ci = _bootstrap(fig, base.records, run.records, same_set[i], rng)
            cells.append(_cell(fig, vb, fig.get(run.summary), ci))
        rows.append(Row(fig.name, fig.unit, fig.better, cells))
    return rows


def settings(s: Summary) -> dict[str, object]:
    """A run's settings flattened one level, bench's server info renamed to simulate's names."""
    out: dict[str, object] = {}
    for k, v in s.config.items():
        if isinstance(v, dict) and k != "slo":
            out.update({f"{k}.{k2}": v2 for k2, v2 in v.items()})
        else:
            out[k] = v
    for src, dst in SERVER_NAMES.items():
        if src in out:
            val = out.pop(src)
            out.setdefault(dst, val)
    if "model" in out:  # bench: the model name it asked for
        out.setdefault("engine.model", out.pop("model"))
    if s.kind == "bench":  # --clients N records one entry per shard (pids, offsets): the count compares
        shards = out.get("clients")
        out["clients"] = len(shards) if isinstance(shards, list) else 1
    return out


def config_diff(runs: list[Run]) -> dict[str, list[object]]:
    """Settings whose values differ between runs (None where a run does not record it)."""
    flat = [settings(r.summary) for r in runs]
    keys = sorted(set().union(*flat))
    return {k: [f.get(k) for f in flat] for k in keys if len({repr(f.get(k)) for f in flat}) > 1}


def warnings(runs: list[Run], diff: dict[str, list[object]]) -> list[str]:
    """What makes the comparison loose: other requests, other workload settings, invalid runs."""
    out = request_sets(runs)
    flat = [settings(r.summary) for r in runs]
    for key in WORKLOAD:
        vals = diff.get(key)
        if vals is not None and all(key in f for f in flat):  # recorded by every run (None: off)
            out.append(
                f"workload setting {key} differs ({', '.join(map(repr, vals))}): the request streams differ"
            )
    clocks = {r.name: latency_clock(r.summary) for r in runs}
    known = {c for c in clocks.values() if c}
    if len(known) > 1 and not known <= ENGINE_TIME:
        on = ", ".join(f"{n} {c}" for n, c in clocks.items() if c)
        out.append(f"latencies on different clocks ({on}): the client's clock adds HTTP and client time")
    for r in runs:
        out += r.problems
        s = r.summary
        if not s.valid:
            out.append(f"{r.name} is INVALID: {s.invalid_reason}")
        if s.cache.contaminated:
            out.append(f"{r.name}'s cache was contaminated: hits above its ceiling")
    return out


def compare_runs(args: argparse.Namespace) -> int:
    """Print (or write as JSON, or as HTML) the comparison of the runs the flags name."""
    from agentkv.bench.compare_view import print_comparison, to_json, write_html

    if len(args.runs) < 2:
        raise UserError("compare: give at least two runs (summary.json files or run folders)")
    runs = [load(p) for p in args.runs]
    rows = compare(runs)
    diff = config_diff(runs)
    warn = warnings(runs, diff)
    if args.out:
        write_html(runs, rows, diff, warn, Path(args.out))
    if args.json:
        print(to_json(runs, rows, diff, warn))
    else:
        print_comparison(runs, rows, diff, warn)
        if args.out:
            print(f"wrote {args.out}")
    return 0
