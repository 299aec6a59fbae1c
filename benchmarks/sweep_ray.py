"""Sweep throughput on a local Ray cluster: 1 vs 2 workers, in alternating pairs, beside the local pool.

One local cluster of 2 CPUs is started once and both its worker processes warmed (the simulator
imported) before any clock starts. Then pairs of timed grids alternate: the grid as tasks of 2 CPUs
(one at a time: one worker busy) and as tasks of 1 CPU (two at a time), through the same
`agentkv.scaleout.raytasks.stream` a `simulate --sweep --ray` uses, so both halves of a pair see
the same host load. Each run is timed from submit to the last result and prints the mean point
inside its task (wall and CPU seconds: CPU below wall means the core was shared), the CPU that
Ray's own processes and the driver used, and the other work on the host in cores (every process's
CPU from /proc/stat less this benchmark's). Prints figures only.

Default grid: lanes=2,4,...,16 x four routers (32 points, 16 per worker), each point the bundled
sample's trees cycled to 800 requests on 2 simulated H200s (about 1 s on an idle core).

Run: .venv/bin/python benchmarks/sweep_ray.py [--pairs 4] [--max-requests 800]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # cluster.py: descendants
from cluster import descendants

GRID = ["lanes=2,4,6,8,10,12,14,16", "router=round_robin,kv_aware,least_loaded,session"]
TARGET = 1.8
TICK = os.sysconf("SC_CLK_TCK")


def _nap(traces, seconds: float) -> int:
    """A warm-up task: the simulator imported and the traces read in the worker before timing."""
    import agentkv.sim.cluster  # noqa: F401

    time.sleep(seconds)
    return os.getpid()


def _timed_point(traces, cfg, overrides: dict, index: int) -> tuple[float, float]:
    """The sweep's own task body (`agentkv.sim.ray_sweep._point`), with its CPU seconds beside."""
    from agentkv.sim.ray_sweep import _point

    t = time.process_time()
    wall = _point(traces, cfg, overrides, index)[3]
    return wall, time.process_time() - t


def _proc_cpu(pid: int) -> tuple[float, str]:
    """(CPU s so far, which Ray process) of `pid`, from /proc; (0, '') once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return 0.0, ""
    name = cmd[0].decode(errors="replace")
    kind = "worker" if name.startswith("ray::") else Path(name).name
    if kind.startswith("python") and len(cmd) > 2:  # Ray's Python agents and monitors: their script
        kind = Path(cmd[2 if cmd[1] == b"-u" else 1].decode(errors="replace")).stem
    return (int(fields[11]) + int(fields[12])) / TICK, kind


def _host_busy() -> float:
    """CPU seconds every process on the host has used (all cores), from /proc/stat."""
    v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(v[i] for i in (0, 1, 2, 5, 6)) / TICK  # user, nice, system, irq, softirq


def _snapshot() -> tuple[float, float, dict[int, tuple[float, str]]]:
    """(wall clock, host busy CPU s, this process's tree: pid -> (CPU s, kind))."""
    me = os.getpid()
    procs = {p: _proc_cpu(p) for p in [me, *descendants(me)]}
    procs[me] = (procs[me][0], "driver")
    return time.perf_counter(), _host_busy(), procs


def _usage(before, after) -> dict[str, float]:
    """CPU s by kind of process between two snapshots, plus `other` (the host's work outside this
    tree) and `wall`."""
    kinds: dict[str, float] = {}
    for pid, (cpu, kind) in after[2].items():
        kinds[kind] = kinds.get(kind, 0.0) + cpu - before[2].get(pid, (0.0, ""))[0]
    kinds["wall"] = after[0] - before[0]
    kinds["other"] = max(0.0, after[1] - before[1] - sum(v for k, v in kinds.items() if k != "wall"))
    return kinds


def _run(ray, stream, traces, calls, cpus: int) -> tuple[float, list[tuple[float, float]], dict]:
    """One timed grid of tasks of `cpus` CPUs each: (wall s, (wall, CPU) s per point, CPU by kind)."""
    before = _snapshot()
    inside = list(stream(ray, _timed_point, traces, calls, cpus=cpus))
    usage = _usage(before, _snapshot())
    return usage["wall"], inside, usage


def _line(label: str, wall: float, inside: list, usage: dict, n: int) -> str:
    own = sum(v for k, v in usage.items() if k not in ("worker", "driver", "other", "wall"))
    return (
        f"  {label}: {wall:6.2f} s ({n / wall:.2f} points/s); a point {statistics.mean(w for w, _ in inside):.2f} s "
        f"inside its task, {statistics.mean(c for _, c in inside):.2f} CPU s; the workers got "
        f"{usage.get('worker', 0) / wall:.2f} cores; Ray's own processes "
        f"{own:.2f} CPU s, the driver {usage.get('driver', 0):.2f}; other work on the host "
        f"{usage['other'] / wall:.2f} cores (load average {os.getloadavg()[0]:.1f})"
    )


def _pair(ray, stream, traces, calls, label: str, total: dict) -> dict[int, float] | None:
    """The grid with 1 worker, then 2: {workers: wall s}, or None (said in one line) when Ray
    lost a task, e.g. a worker killed when the shared host ran low on memory."""
    walls = {}
    for workers in (1, 2):  # tasks of 2 CPUs run one at a time, of 1 CPU two at a time
        try:
            walls[workers], inside, usage = _run(ray, stream, traces, calls, 3 - workers)
        except ray.exceptions.RayError as e:
            print(f"  {label}, {workers} worker(s): failed, left out: {str(e).splitlines()[0][:200]}")
            return None
        print(_line(f"{label}, {workers} worker(s)", walls[workers], inside, usage, len(calls)))
        for kind, v in usage.items():
            total[kind] = total.get(kind, 0.0) + v
    return walls


def on_ray(traces, configs, grid, pairs: int) -> tuple[list[float], dict[str, float]]:
    """Per pair, 1-worker seconds over 2-worker seconds; and CPU s by kind over every run."""
    from agentkv.scaleout.raytasks import connect, import_ray, stream

    ray = import_ray("local")
    t0 = time.perf_counter()
    connect(ray, "local", 2)
    try:
        pids = set(stream(ray, _nap, traces, [(1.0,), (1.0,)]))  # both workers up, imports done
        print(f"cluster of 2 CPUs up, {len(pids)} workers warm in {time.perf_counter() - t0:.1f} s")
        calls = [(c, g, i) for i, (c, g) in enumerate(zip(configs, grid, strict=True))]
        ratios, total = [], {}
        for k in range(pairs):
            walls = _pair(ray, stream, traces, calls, f"pair {k + 1}", total)
            if walls:
                ratios.append(walls[1] / walls[2])
                print(f"  pair {k + 1}: speed-up {ratios[-1]:.2f}x")
        return ratios, total
    finally:
        ray.shutdown()


def _local(configs, grid) -> float:
    """Seconds for the grid in the local pool of two processes (`simulate --sweep` without --ray)."""
    from agentkv.sim.sweep import _local_points
    from agentkv.terminal import StopRequest

    t = time.perf_counter()
    ns = argparse.Namespace(paths=[], format="auto")
    assert sum(1 for _ in _local_points(ns, configs, grid, StopRequest())) == len(grid)
    return time.perf_counter() - t


def _entered(traces, i: int) -> float:
    """A trivial task: the wall clock when its body starts (the shared traces in hand)."""
    return time.time()


def shared_cost(paths: list[str], tasks: int = 8) -> None:
    """`tasks` trivial tasks over the traces at `paths` on 2 workers: the traces read from the store
    once per worker (`raytasks.stream`) against once per task (a top-level reference)."""
    from agentkv.scaleout.raytasks import connect, import_ray, stream
    from agentkv.trace.formats import load_paths

    traces = list(load_paths(paths, "auto"))
    ray = import_ray("local")
    connect(ray, "local", 2)
    try:
        list(stream(ray, _nap, [], [(0.5,), (0.5,)]))  # both workers up
        t = time.time()
        starts = sorted(stream(ray, _entered, traces, [(i,) for i in range(tasks)]))
        once = time.time() - t
        print(
            f"{len(traces)} traces, {tasks} tasks, once per worker: {once:.2f} s with the ray.put, "
            f"last task entered at {starts[-1] - t:.2f} s"
        )
        ref = ray.put(traces)
        task = ray.remote(num_cpus=1, max_retries=0)(_entered)
        t = time.time()
        starts = sorted(ray.get([task.remote(ref, i) for i in range(tasks)]))
        print(
            f"  once per task: {time.time() - t:.2f} s after the ray.put, last task entered at "
            f"{starts[-1] - t:.2f} s (load average {os.getloadavg()[0]:.1f})"
        )
    finally:
        ray.shutdown()


def _summary(ratios: list[float], total: dict[str, float]) -> None:
    if not ratios:
        print("speed-up, 2 vs 1 Ray workers: no pair finished (missed: not measured)")
        return
    met = sum(r >= TARGET for r in ratios)
    print(
        f"speed-up, 2 vs 1 Ray workers: {' / '.join(f'{r:.2f}x' for r in ratios)}; median "
        f"{statistics.median(ratios):.2f}x; >= {TARGET}x in {met} of {len(ratios)} pairs "
        f"({'met' if met == len(ratios) else 'missed' if met == 0 else 'met in part'})"
    )
    wall = total.pop("wall")
    other = total.pop("other")
    parts = ", ".join(f"{k} {v:.2f}" for k, v in sorted(total.items(), key=lambda kv: -kv[1]))
    print(
        f"CPU s over all {wall:.0f} s of timed runs: {parts}; other work on the host {other / wall:.2f} cores"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=4, help="pairs of timed grids, 1 then 2 workers (default 4)")
    ap.add_argument(
        "--max-requests",
        type=int,
        default=800,
        help="requests a point, the sample's trees cycled (default 800: about 1 s a point on an idle core)",
    )
    ap.add_argument("--no-local", action="store_true", help="skip the local pool's run")
    ap.add_argument(
        "--shared-traces",
        nargs="+",
        metavar="PATH",
        help="instead: time 8 trivial tasks over these traces, read once per worker against once per task",
    )
    opts = ap.parse_args()
    if opts.shared_traces:
        return shared_cost(opts.shared_traces)
    from agentkv.engine.config import EngineConfig
    from agentkv.sim.cluster import SimConfig
    from agentkv.sim.sweep import apply, parse_sweep
    from agentkv.trace.formats import bundled_sample, load_paths

    traces = list(load_paths(bundled_sample(), "auto"))
    base = SimConfig(engine=EngineConfig(), workers=2, cycle=True, max_requests=opts.max_requests)
    grid = parse_sweep(GRID)
    configs = [apply(base, g) for g in grid]
    print(f"grid: {len(grid)} points ({' x '.join(GRID)}), {opts.max_requests} requests a point")
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} (shared)")
    if not opts.no_local:
        local = _local(configs, grid)
        print(f"local pool of 2 processes: {local:.2f} s, {len(grid) / local:.2f} points/s")
    _summary(*on_ray(traces, configs, grid, opts.pairs))


if __name__ == "__main__":
    main()
