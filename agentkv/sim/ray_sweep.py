"""`agentkv simulate --sweep ... --ray [ADDRESS]`: each grid point a Ray task over the traces put once
in the object store (the plumbing in agentkv.scaleout.raytasks)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import msgspec

from agentkv.scaleout.raytasks import import_ray, run_tasks

__all__ = ["import_ray", "run_points"]


def _point(traces, cfg, overrides: dict, index: int) -> tuple[int, dict, bytes, float]:
    """One grid point in a Ray worker: (index, overrides, the summary as JSON, wall seconds)."""
    from agentkv.sim.cluster import simulate

    res = simulate(traces, cfg)
    return index, overrides, msgspec.json.encode(res.summary), res.wall_s


def run_points(
    traces, configs: Sequence, grid: Sequence[dict], address: str, num_cpus: int | None = None, stop=None
) -> Iterator[tuple[int, dict, bytes, float]]:
    """Every (config, overrides) point on the cluster at `address`, yielded as they finish; with
    `stop` (a StopRequest), the points not finished once it is requested are dropped."""
    calls = [(c, g, i) for i, (c, g) in enumerate(zip(configs, grid, strict=True))]
    return run_tasks(_point, list(traces), calls, address, num_cpus, stop)
