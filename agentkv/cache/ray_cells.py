"""`agentkv cache analyze --ray [ADDRESS]`: each (block size, capacity, policy) cell a Ray task; the
grid and the block accesses of every block size, packed into arrays (`cache/packed.py`), are put once
in the object store and unpacked once per worker process and block size."""

from __future__ import annotations

from agentkv.cache.analyze import CellResult, run_cell
from agentkv.cache.grid import Grid
from agentkv.cache.packed import PackedRequests
from agentkv.scaleout.raytasks import run_tasks
from agentkv.trace.accesses import BlockRequest


def _cell(shared: tuple[Grid, dict[int, PackedRequests]], block_size: int, capacity, policy: str):
    """One cell in a Ray worker, replayed from the shared accesses (unpacked on first use)."""
    grid, packed = shared
    return run_cell(grid, packed[block_size].requests(), block_size, capacity, policy)


def run_on_ray(
    grid: Grid, requests: dict[int, list[BlockRequest]], cells: list, address: str, tick
) -> list[CellResult]:
    """Every cell on the cluster at `address`, each counted by `tick` as it finishes; `cells` order.
    On `tick`'s stop request (Ctrl-C) the cells finished so far: the ones in hand are dropped, not
    waited for (`raytasks.stream`), and no cluster is joined once it has come."""
    if tick.stopped():  # Ctrl-C while the accesses were built
        return []
    packed = {bs: PackedRequests.pack(reqs) for bs, reqs in requests.items()}
    results = []
    for r in run_tasks(_cell, (grid, packed), cells, address, stop=tick.stop):
        results.append(r)
        tick.step(f"{r.policy} at {r.capacity}, block size {r.block_size}")
    order = {(bs, cap[0], pol): i for i, (bs, cap, pol) in enumerate(cells)}
    return sorted(results, key=lambda r: order[(r.block_size, r.capacity, r.policy)])
