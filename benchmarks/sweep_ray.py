"""Sweep throughput on a local Ray cluster with 1 vs 2 CPUs (worker processes), beside the local pool.

The grid: the bundled sample traces (178 requests) on 2 simulated H200s, lanes x router (16 points),
every request. Each Ray cluster is started once, its workers warmed with one task per CPU, then the
grid is timed from submit to the last result (cluster start printed apart). The machine may be
shared: the load average is printed beside each figure. Prints figures only.

Run: .venv/bin/python benchmarks/sweep_ray.py [--repeat 3] [--max-requests N]
"""

from __future__ import annotations

import argparse
import os
import time

from agentkv.engine.config import EngineConfig
from agentkv.scaleout.raytasks import connect, import_ray, stream
from agentkv.sim.cluster import SimConfig
from agentkv.sim.ray_sweep import _point
from agentkv.sim.sweep import _local_points, apply, parse_sweep
from agentkv.terminal import StopRequest
from agentkv.trace.formats import bundled_sample, load_paths

GRID = ["lanes=2,4,8,16", "router=round_robin,kv_aware,least_loaded,session"]


def _nap(seconds: float) -> None:
    import agentkv.sim.cluster  # noqa: F401  (the simulator imported in every worker before timing)

    time.sleep(seconds)


def _warm(ray, n: int) -> None:
    """One short task per CPU so that every worker process exists before the clock starts."""
    ray.get([ray.remote(num_cpus=1)(_nap).remote(0.5) for _ in range(n)])


def on_ray(num_cpus: int, traces, configs, grid, repeat: int) -> list[float]:
    """Seconds per grid, `repeat` times, on a new local cluster of `num_cpus` CPUs."""
    ray = import_ray()
    t0 = time.perf_counter()
    connect(ray, "local", num_cpus)
    try:
        _warm(ray, num_cpus)
        print(f"  cluster of {num_cpus} CPU(s) up and warm in {time.perf_counter() - t0:.1f} s")
        runs = []
        for _ in range(repeat):
            t = time.perf_counter()
            calls = [(c, g, i) for i, (c, g) in enumerate(zip(configs, grid, strict=True))]
            inside = [wall for *_, wall in stream(ray, _point, list(traces), calls)]
            runs.append(time.perf_counter() - t)
            assert len(inside) == len(grid)
            print(
                f"    grid {runs[-1]:.2f} s; a point takes {sum(inside) / len(inside):.2f} s inside its task"
            )
        return runs
    finally:
        ray.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--max-requests",
        type=int,
        default=None,
        help="requests per point, the sample's trees cycled (default: the sample once, 178); "
        "larger points leave Ray's and the host's per-task jitter a smaller share",
    )
    opts = ap.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    traces = load_paths(bundled_sample(), "auto")
    more = dict(cycle=True, max_requests=opts.max_requests) if opts.max_requests else {}
    base = SimConfig(engine=EngineConfig(), workers=2, **more)
    grid = parse_sweep(GRID)
    configs = [apply(base, g) for g in grid]
    n = opts.max_requests or sum(len(t.timeline()) for t in traces)
    print(f"grid: {len(grid)} points ({' x '.join(GRID)}), {n} requests a point from {len(traces)} traces")
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} (shared)")
    t = time.perf_counter()
    ns = argparse.Namespace(paths=[], format="auto")
    assert sum(1 for _ in _local_points(ns, configs, grid, StopRequest())) == len(grid)
    local = time.perf_counter() - t
    print(f"local pool of 2 processes: {local:.2f} s, {len(grid) / local:.2f} points/s")
    best = {}
    for cpus in (1, 2):
        runs = on_ray(cpus, traces, configs, grid, opts.repeat)
        best[cpus] = min(runs)
        print(
            f"ray, {cpus} CPU(s): {' / '.join(f'{r:.2f}' for r in runs)} s per grid, best "
            f"{len(grid) / best[cpus]:.2f} points/s (load average {os.getloadavg()[0]:.2f})"
        )
    print(f"speed-up, 2 vs 1 Ray CPUs: {best[1] / best[2]:.2f}x (target >= 1.8x)")


if __name__ == "__main__":
    main()
