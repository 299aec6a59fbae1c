"""`agentkv simulate --sweep`: a grid of overrides applied to the typed SimConfig with
`dataclasses.replace` (so every point is validated like a flag), run in worker processes."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
import time
import typing
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path

import msgspec
from rich.console import Console
from rich.table import Table

from agentkv.engine.config import EngineConfig
from agentkv.errors import UserError
from agentkv.metrics.report_sweep import write_sweep_html
from agentkv.metrics.summary import Summary, write_summary
from agentkv.metrics.validity import EXIT_INVALID
from agentkv.metrics.view import ms, num, pct
from agentkv.placement import queue_cap_arg
from agentkv.sim.cluster import SimConfig, simulate
from agentkv.sim.deploy_args import disagg_fields
from agentkv.sim.knee import best_line, knees
from agentkv.terminal import EXIT_INTERRUPTED, StopRequest, ignore_sigint, show
from agentkv.trace.command import selection_of
from agentkv.units import parse_capacity, parse_duration

_GIB = float(1 << 30)
_OFF = ("0", "none", "off")
# flag names that are not the field's own name: key -> (config field, how its value is read)
_ALIASES = {
    "cpu_offload": (
        "kv_offloading_size",
        lambda v: 0.0 if v.lower() in _OFF else parse_capacity(v, "cpu_offload") / _GIB,
    ),
    "disk_offload": (
        "kv_disk_size",
        lambda v: 0.0 if v.lower() in _OFF else parse_capacity(v, "disk_offload") / _GIB,
    ),
    "tp": ("tensor_parallel_size", None),
    "prefix_caching_hash_algo": ("hash_algo", None),
    "idle_gap_cap": (
        "idle_gap_cap",
        lambda v: None if v.lower() in _OFF else parse_duration(v, "idle_gap_cap"),
    ),
    "duration": ("duration", lambda v: None if v.lower() in _OFF else parse_duration(v, "duration")),
}
_SIM_FIELDS = {f.name for f in dataclasses.fields(SimConfig)} - {"engine", "sample_every", "bursts"}
_ALIASES["prefill_tp"] = ("prefill_tensor_parallel_size", None)
_ALIASES["decode_tp"] = ("decode_tensor_parallel_size", None)
_ALIASES["prefill_dp"] = ("prefill_data_parallel_size", None)
_ALIASES["decode_dp"] = ("decode_data_parallel_size", None)
_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)} - {"seed"}
_HINTS = {**typing.get_type_hints(EngineConfig), **typing.get_type_hints(SimConfig)}


def _queue_cap(raw: str) -> float:
    """--sweep kv_queue_cap's value: as --kv-queue-cap reads it (none: uncapped)."""
    try:
        return queue_cap_arg(raw)
    except argparse.ArgumentTypeError as e:
        raise UserError(f"--sweep kv_queue_cap: {e}") from None


_ALIASES["kv_queue_cap"] = ("kv_queue_cap", _queue_cap)


def _field(key: str) -> str:
    """The config field a sweep key sets (UserError for an unknown key)."""
    name = _ALIASES[key][0] if key in _ALIASES else key
    if name == "disagg":  # sets prefill_workers and decode_workers at once (agentkv.sim.knee)
        return name
    if name not in _SIM_FIELDS and name not in _ENGINE_FIELDS:
        raise UserError(
            f"--sweep: unknown setting '{key}' (use a simulate flag name, e.g. lanes, "
            "cpu_offload, gpu_memory_utilization, router, gpu)"
        )
    return name


def parse_sweep(specs: list[str]) -> list[dict[str, str]]:
    """`key=v1,v2` specs -> the grid of overrides (product over keys), keys checked against the config."""
    axes: list[tuple[str, list[str]]] = []
    for spec in specs:
        key, sep, vals = spec.partition("=")
        key = key.strip().lstrip("-").replace("-", "_")
        if not sep or not vals:
            raise UserError(f"--sweep: expected KEY=V1,V2,..., got {spec!r}")
        _field(key)
        axes.append((key, [v.strip() for v in vals.split(",") if v.strip()]))
    keys = [k for k, _ in axes]
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*[v for _, v in axes])]


def _value(key: str, name: str, raw: str):
    """A sweep value read as its field's type: an int, a number, a flag, a size, a duration or text."""
    if key in _ALIASES and _ALIASES[key][1] is not None:
        return _ALIASES[key][1](raw)
    hint = _HINTS[name]
    if hint is bool:
        return raw.lower() in ("1", "true", "yes", "on")
    for typ, what in ((int, "an integer"), (float, "a number")):
        if hint in (typ, typ | None):
            if hint is not typ and raw.lower() in ("none", "off"):
                return None
            try:
                return typ(raw)
            except ValueError:
                raise UserError(f"--sweep {key}: expected {what}, got {raw!r}") from None
    return raw


def apply(cfg: SimConfig, overrides: dict[str, str]) -> SimConfig:
    """`cfg` with the overrides set (`dataclasses.replace`: each new config validates itself)."""
    sim: dict[str, object] = {}
    engine: dict[str, object] = {}
    for key, raw in overrides.items():
        name = _field(key)
        if name == "disagg":
            sim.update(disagg_fields(raw))
            continue
        (sim if name in _SIM_FIELDS else engine)[name] = _value(key, name, raw)
    if engine:
        sim["engine"] = dataclasses.replace(cfg.engine, **engine)
    return dataclasses.replace(cfg, **sim)


def _run_one(payload) -> tuple[dict, bytes, float, float]:
    from agentkv.sim.command import load_traces

    args, cfg, overrides = payload
    res = simulate(load_traces(args)[0], cfg)
    return overrides, msgspec.json.encode(res.summary), res.wall_s, res.sim_s


_COLUMNS = ("TTFT p50", "TTFT p99", "TPOT p50", "hit rate", "CPU hits", "out tok/s", "out tok/s/GPU")


def _table(keys: list[str], results: list[tuple[dict, Summary]]) -> Table:
    """One row per grid point: its settings, then latency, hits, throughput, preemptions, failures."""
    table = Table(title="simulate sweep")
    for k in keys:
        table.add_column(k)
    for col in (*_COLUMNS, "preempt", "failed", "tier"):
        table.add_column(col, justify="right")
    for overrides, s in results:
        tp = s.throughput
        table.add_row(
            *[overrides[k] for k in keys],
            ms(s.ttft.p50),
            ms(s.ttft.p99),
            ms(s.tpot.p50),
            pct(s.cache.reported),
            pct(s.cache.by_tier.get("CPU")),
            num(tp.output_tokens_per_s if tp else None),
            num(tp.output_tokens_per_s_per_gpu if tp else None),
            f"{s.preemptions:,}",
            f"{s.failed:,}",
            "-" if s.interactivity is None else ("met" if s.interactivity.met else "missed"),
        )
    return table


def print_knee(results: list[tuple[dict, Summary]], console: Console) -> None:
    """Per setting of the other keys, the most lanes meeting the interactivity tier (agents per GPU,
    per MW); with more than one setting, the best by agents per MW."""
    found = knees(results)
    for where, k, top in found:
        if k is None:
            console.print(f"knee ({where}): no point meets the tier")
            continue
        console.print(
            f"knee ({where}): {'at least ' if top else ''}{k.sessions} lanes meet tps>={k.tier_tps:g}, "
            f"TTFT p90<={k.tier_ttft_p90:g}s with {k.agents:,.1f} session trees in progress: "
            f"{k.agents_per_gpu:,.2f} agents/GPU, {k.agents_per_mw:,.0f} agents/MW ({k.power_basis})"
        )
    if len(found) > 1:
        console.print(best_line(found))


def _local_points(args: argparse.Namespace, configs: list[SimConfig], grid: list[dict], stop: StopRequest):
    """(index, overrides, summary JSON, wall s) of every point as it finishes, from two local
    processes; on a stop request the points not finished are dropped and the workers ended."""
    payloads = [(args, c, g) for c, g in zip(configs, grid, strict=True)]
    pool = ProcessPoolExecutor(max_workers=min(len(grid), 2), initializer=ignore_sigint)
    futures = {pool.submit(_run_one, p): i for i, p in enumerate(payloads)}
    pending = set(futures)
    try:
        while pending and not stop.requested:
            done, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
            for f in sorted(done, key=futures.__getitem__):
                overrides, blob, wall, _ = f.result()
                yield futures[f], overrides, blob, wall
    finally:
        if not pending:  # every point done: a full shutdown (`wait=False` leaves CPython's executor
            pool.shutdown(wait=True)  # thread to race the interpreter's exit: "Bad file descriptor")
        else:
            workers = list(getattr(pool, "_processes", {}).values())
            pool.shutdown(wait=False, cancel_futures=True)
            for w in workers:  # the points in hand: dropped
                w.terminate()


def _points(args: argparse.Namespace, configs: list[SimConfig], grid: list[dict], stop: StopRequest):
    """The grid's results as they finish: on a Ray cluster with `--ray`, else in local processes."""
    if getattr(args, "ray", None) is None:
        return _local_points(args, configs, grid, stop)
    from agentkv.sim.command import load_traces
    from agentkv.sim.ray_sweep import import_ray, run_points

    import_ray(args.ray)  # the install hint before the traces load
    return run_points(load_traces(args)[0], configs, grid, args.ray, stop=stop)


def _eta(started: float, done: int, total: int) -> str:
    """`3/8 points, 41 s elapsed, ETA 1m08s` (ETA: the mean time a point has taken so far)."""
    elapsed = time.monotonic() - started
    line = f"{done}/{total} points, {_secs(elapsed)} elapsed"
    return line + (f", ETA {_secs(elapsed / done * (total - done))}" if 0 < done < total else "")


def _secs(x: float) -> str:
    return f"{x:.0f} s" if x < 60 else f"{int(x // 60)}m{int(x % 60):02d}s"


def _collect(args, configs, grid, console: Console) -> tuple[dict[int, tuple[dict, Summary]], bool]:
    """Every point's summary as it finishes, with progress and an ETA; the first Ctrl-C keeps the
    finished points and drops the rest, a second stops at once. Returns (points, interrupted)."""
    done: dict[int, tuple[dict, Summary]] = {}
    started = time.monotonic()
    note = (
        "agentkv: stopping: keeping the finished points, dropping the ones in hand (Ctrl-C again to quit now)"
    )
    with StopRequest(note) as stop:
        for i, overrides, blob, wall in _points(args, configs, grid, stop):
            done[i] = (overrides, msgspec.json.decode(blob, type=Summary))
            point = " ".join(f"{k}={v}" for k, v in overrides.items())
            console.print(f"[dim]{_eta(started, len(done), len(grid))}: done {point} ({wall:.1f} s)[/dim]")
            if stop.requested:
                break
    return done, stop.requested


def _grid_results(args: argparse.Namespace, base: SimConfig, console: Console):
    """(sweep keys, (overrides, summary) per finished grid point in grid order, points in the grid,
    interrupted)."""
    grid = parse_sweep(args.sweep)
    configs = [apply(base, g) for g in grid]  # fail fast on a bad value, before spawning processes
    done, interrupted = _collect(args, configs, grid, console)
    return list(grid[0]), [done[i] for i in sorted(done)], len(grid), interrupted


def run_sweep(args: argparse.Namespace, base: SimConfig, console: Console) -> int:
    """Run every grid point (two processes, or Ray tasks) or search lanes=LO..HI for the knee, then
    print the table or JSON and write summaries; interrupted, the finished points are printed and
    written and the exit status is 130."""
    from agentkv.sim.knee import search_results, split_range

    if split_range(args.sweep)[1] is not None:
        keys, results = search_results(args, base, console)
        total, interrupted = len(results), False
    else:
        keys, results, total, interrupted = _grid_results(args, base, console)
    for _, s in results:  # as a single run records it, so `agentkv compare` sees a different selection
        s.config["selection"] = selection_of(args)
    if args.json:
        out = [{"overrides": o, "summary": msgspec.to_builtins(s)} for o, s in results]
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(out), indent=2).decode() + "\n")
    elif results:
        show(Console(), _table(keys, results))
        if "lanes" in keys:
            print_knee(results, Console())
    if args.out:
        out_dir = Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        points = []
        for i, (overrides, s) in enumerate(results):
            name = "-".join(f"{k}={v}" for k, v in overrides.items()).replace("/", "_") or str(i)
            write_summary(s, out_dir / f"summary-{name}.json")
            points.append((overrides, s, f"summary-{name}.json"))
        write_sweep_html(out_dir / "sweep.html", keys, points, total)
    if interrupted:
        print(f"agentkv: interrupted: {len(results)} of {total} points done (written)", file=sys.stderr)
        return EXIT_INTERRUPTED
    bad = [(o, s.invalid_reason) for o, s in results if not s.valid]
    for o, why in bad:
        print(f"agentkv: invalid point {o}: {why}", file=sys.stderr)
    return EXIT_INVALID if bad else 0  # as a single run (outputs written)
