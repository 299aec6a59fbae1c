"""Ray plumbing shared by `simulate --sweep --ray`, `cache analyze --ray` and `bench --ray`: the `--ray`
flag, joining (or starting) a cluster, and tasks over one shared object streamed back as they finish
(bench's shard actors: agentkv.bench.ray_shards). Ray is imported only when `--ray` is given
(optional extra agentkv[ray])."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator, Sequence

from agentkv.errors import UserError

INSTALL_HINT = "--ray needs Ray: pip install 'agentkv[ray]'"
LOCAL = "local"  # `--ray` with no address: a new single-machine cluster, stopped at the end


def add_ray_arg(p: argparse.ArgumentParser, what: str, kind: str = "tasks") -> None:
    """`--ray [ADDRESS]`: run `what` (e.g. "the sweep's points") as Ray `kind` (tasks, actors)."""
    p.add_argument(
        "--ray",
        nargs="?",
        const=LOCAL,
        default=None,
        metavar="ADDRESS",
        help=f"run {what} as Ray {kind}: on the cluster at ADDRESS (auto, ray://host:port, "
        "host:port) or, with no address, a new local cluster (needs pip install 'agentkv[ray]')",
    )


def import_ray(address: str | None = None):
    """The `ray` module, or a UserError saying how to install it.

    For a new local cluster (`address` LOCAL), Ray's default made explicit before Ray is first
    imported (it reads RAY_AUTH_MODE then): token authentication on. Ray 2.60 prints "Token
    authentication is enabled ..." on every start when it turns it on itself, nothing when the
    variable says so. A value the user set is kept; joining a cluster leaves it to the user."""
    if address == LOCAL and "ray" not in sys.modules:
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    try:
        import ray
    except ImportError:
        raise UserError(INSTALL_HINT) from None
    return ray


def connect(ray, address: str, num_cpus: int | None = None) -> None:
    """Join the cluster at `address` (`auto`, `ray://host:port`, `host:port`) or start a local one.

    ray.init replaces the SIGTERM handler with sys.exit; the caller's (the event loop's stop
    request) is put back, so a stopped run still writes what finished."""
    quiet = {"log_to_driver": False, "configure_logging": False}
    main = threading.current_thread() is threading.main_thread()
    term = signal.getsignal(signal.SIGTERM) if main else None
    try:
        if address == LOCAL:
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            ray.init(num_cpus=num_cpus, include_dashboard=False, **quiet)
            return
        reachable(address)
        try:
            ray.init(address=address, **quiet)
        except (ConnectionError, ValueError, RuntimeError) as e:
            raise UserError(f"--ray {address}: cannot join the Ray cluster ({e})") from None
    finally:
        if term is not None:
            signal.signal(signal.SIGTERM, term)


def reachable(address: str, timeout: float = 5.0) -> None:
    """A UserError at once when nothing listens at `host:port` (Ray itself retries for minutes)."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        return  # `auto`, or an address Ray resolves itself
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as e:
        raise UserError(f"--ray {address}: cannot join the Ray cluster ({e.strerror or e})") from None


_HELD: dict[str, object] = {}  # in a worker process: the current stream's shared object, by object id


def _shared(box: list):
    """The shared object, taken from the object store once per worker process, not once a task
    (unpickling the 119-trace Claude Code corpus takes about 1 s, a real sweep point tens of s)."""
    ref = box[0]
    key = ref.hex()
    if key not in _HELD:
        import ray

        _HELD.clear()  # one stream's object at a time: a worker holds no stale copy
        _HELD[key] = ray.get(ref)
    return _HELD[key]


def _call(fn: Callable, box: list, *call):
    """A task: `fn(shared, *call)`; the reference comes in a list so that Ray passes it unresolved."""
    return fn(_shared(box), *call)


def stream(ray, fn: Callable, shared: object, calls: Sequence[tuple], stop=None, cpus: float = 1) -> Iterator:
    """`fn(shared, *call)` for every call as a task of `cpus` CPUs (one, like a local process),
    yielded as they finish.

    `shared` is `ray.put` once and read from the store once per worker process. With `stop` (a
    StopRequest), the wait wakes every 0.5 s to look at it and, once it is requested, the tasks not
    finished are dropped (they end with the driver's job); without, it blocks until a task ends."""
    task = ray.remote(num_cpus=cpus, max_retries=0)(_call)
    box = [ray.put(shared)]
    pending = [task.remote(fn, box, *call) for call in calls]
    while pending and not (stop is not None and stop.requested):
        done, pending = ray.wait(pending, num_returns=1, timeout=None if stop is None else 0.5)
        for ref in done:
            yield ray.get(ref)


def run_tasks(
    fn: Callable,
    shared: object,
    calls: Sequence[tuple],
    address: str,
    num_cpus: int | None = None,
    stop=None,
) -> Iterator:
    """Join (or start) the cluster, stream `fn(shared, *call)` for every call, then disconnect.

    A task's own UserError reads as it would locally (one line, exit 2), and so does a task whose
    worker Ray's memory monitor killed (the node short of memory: a setup to change, not a bug)."""
    ray = import_ray(address)
    connect(ray, address, num_cpus)
    try:
        yield from stream(ray, fn, shared, calls, stop)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, UserError):
            raise UserError(str(e.cause)) from None
        raise
    except ray.exceptions.OutOfMemoryError as e:
        first = str(e).strip().splitlines()[0]
        raise UserError(
            f"--ray: Ray's memory monitor killed a task's worker: {first} "
            "(free or add memory on the node, or run fewer tasks at once)"
        ) from None
    finally:
        ray.shutdown()
