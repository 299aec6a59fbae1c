"""`agentkv simulate --sweep ... --ray [ADDRESS]`: each grid point a Ray task, the traces put once
in the object store, results yielded as they finish. Ray is imported only here (optional extra)."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator, Sequence

import msgspec

from agentkv.errors import UserError

INSTALL_HINT = "--ray needs Ray: pip install 'agentkv[ray]'"
LOCAL = "local"  # `--ray` with no address: a new single-machine cluster, stopped at the end


def import_ray():
    """The `ray` module, or a UserError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise UserError(INSTALL_HINT) from None
    return ray


def connect(ray, address: str, num_cpus: int | None = None) -> None:
    """Join the cluster at `address` (`auto`, `ray://host:port`, `host:port`) or start a local one."""
    quiet = {"log_to_driver": False, "configure_logging": False}
    if address == LOCAL:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        ray.init(num_cpus=num_cpus, include_dashboard=False, **quiet)
        return
    _reachable(address)
    try:
        ray.init(address=address, **quiet)
    except (ConnectionError, ValueError, RuntimeError) as e:
        raise UserError(f"--ray {address}: cannot join the Ray cluster ({e})") from None


def _reachable(address: str, timeout: float = 5.0) -> None:
    """A UserError at once when nothing listens at `host:port` (Ray itself retries for minutes)."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        return  # `auto`, or an address Ray resolves itself
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as e:
        raise UserError(f"--ray {address}: cannot join the Ray cluster ({e.strerror or e})") from None


def _point(traces, cfg, overrides: dict, index: int) -> tuple[int, dict, bytes, float]:
    """One grid point in a Ray worker: (index, overrides, the summary as JSON, wall seconds)."""
    from agentkv.sim.cluster import simulate

    res = simulate(traces, cfg)
    return index, overrides, msgspec.json.encode(res.summary), res.wall_s


def stream(ray, traces, configs: Sequence, grid: Sequence[dict]) -> Iterator[tuple[int, dict, bytes, float]]:
    """Every (config, overrides) point as a task on the joined cluster, yielded as they finish."""
    task = ray.remote(num_cpus=1, max_retries=0)(_point)
    shared = ray.put(list(traces))  # shipped once; every task reads the same object
    pending = [task.remote(shared, c, g, i) for i, (c, g) in enumerate(zip(configs, grid, strict=True))]
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        yield ray.get(done[0])


def run_points(
    traces, configs: Sequence, grid: Sequence[dict], address: str, num_cpus: int | None = None
) -> Iterator[tuple[int, dict, bytes, float]]:
    """Join (or start) the cluster, stream every point through it, then disconnect."""
    ray = import_ray()
    connect(ray, address, num_cpus)
    try:
        yield from stream(ray, traces, configs, grid)
    except ray.exceptions.RayTaskError as e:  # a point's own UserError reads as it would locally
        if isinstance(e.cause, UserError):
            raise UserError(str(e.cause)) from None
        raise
    finally:
        ray.shutdown()
