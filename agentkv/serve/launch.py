"""`agentkv serve`: one server in this process, or N workers on consecutive ports as child processes.

Workers are spawned processes (no shared state); worker i listens on `port + i` and publishes
KV events on the endpoint's port + i (the replay endpoint likewise). The parent prints each
worker's URL and endpoints once it is up, and on SIGINT/SIGTERM (or a worker dying) stops them
all: SIGTERM, a grace period, then SIGKILL. Children also die with the parent (PDEATHSIG).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing as mp
import queue
import re
import signal
import sys
import time
from collections.abc import Sequence

from agentkv.engine.config import EngineConfig
from agentkv.errors import UserError
from agentkv.gate.options import HttpLimits
from agentkv.serve.app import ServeOptions

log = logging.getLogger("agentkv.serve")
_TCP_PORT = re.compile(r"^(tcp://.+:)(\d+)$")
GRACE_S = 10.0


def shift_endpoint(endpoint: str | None, i: int, flag: str) -> str | None:
    """`tcp://host:5557` -> `tcp://host:{5557 + i}`; other endpoints cannot be numbered (UserError)."""
    if endpoint is None or i == 0:
        return endpoint
    m = _TCP_PORT.match(endpoint)
    if m is None:
        raise UserError(
            f"{flag} {endpoint}: with --workers > 1 it must be tcp://HOST:PORT (ports go up by one)"
        )
    return f"{m.group(1)}{int(m.group(2)) + i}"


def worker_options(opts: ServeOptions, n: int, curves: Sequence | None = None) -> list[ServeOptions]:
    """The options of workers 0..n-1: consecutive HTTP ports and event endpoints, checked for clashes,
    and each worker's CURVE key pair (`curves`, default: every worker `opts.kv_events_curve`)."""
    curves = list(curves) if curves is not None else [opts.kv_events_curve] * n
    if n > 1 and curves[0] is not None and len({c.public for c in curves}) == 1:
        log.warning(
            "KV events: the %d workers share one CURVE key, so a router cannot tell them apart by key; "
            "give --kv-events-curve-secret-key a folder of worker-I.key_secret files (docs/security.md)",
            n,
        )
    if n > 1 and opts.port == 0:
        raise UserError("--workers > 1 needs an explicit --port (workers use consecutive ports)")
    if opts.port + n - 1 > 65535:
        raise UserError(f"--port {opts.port} + {n} workers runs past port 65535")
    out = [
        dataclasses.replace(
            opts,
            port=opts.port + i,
            kv_events_endpoint=shift_endpoint(opts.kv_events_endpoint, i, "--kv-events-endpoint"),
            kv_events_replay_endpoint=shift_endpoint(
                opts.kv_events_replay_endpoint, i, "--kv-events-replay-endpoint"
            ),
            kv_events_curve=curves[i],
        )
        for i in range(n)
    ]
    used: dict[str, str] = {}
    for i, o in enumerate(out):
        for e in (o.kv_events_endpoint, o.kv_events_replay_endpoint):
            if e is not None:
                port = e.rsplit(":", 1)[-1]
                if port in used and used[port] != e:
                    raise UserError(
                        f"worker {i}: event port {port} is also used by {used[port]}; "
                        "space the --kv-events-endpoint and --kv-events-replay-endpoint ports apart"
                    )
                used[port] = e
    return out


def _describe(server, index: int | None = None) -> str:
    who = f"worker {index}: " if index is not None else ""
    line = f"{who}{server.url}  model={server.model_name}"
    if server.publisher is not None:
        line += f"  kv-events={server.publisher.endpoint}"
        if server.publisher.replay_endpoint:
            line += f"  replay={server.publisher.replay_endpoint}"
        if server.publisher.curve is not None:
            line += f"  curve=on  curve-public-key={server.publisher.curve.public.decode()}"
    return line


def run_one(config: EngineConfig, opts: ServeOptions, *, index: int | None = None, ready=None) -> int:
    """Serve in this process until SIGINT/SIGTERM; `ready(line)` (default: print) once listening."""
    from agentkv.serve.app import Server, serve_until_stopped

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        server = Server(config, opts)

        def on_ready(s) -> None:
            line = _describe(s, index)
            if ready is None:
                print(f"agentkv serve: {line}", flush=True)
            else:
                ready(line)

        await serve_until_stopped(server, stop, on_ready)

    asyncio.run(main())
    return 0


def _worker_main(config: EngineConfig, opts: ServeOptions, index: int, log_level: int, q) -> None:
    """A child process: serve, report ready (or the error) on `q`."""
    _die_with_parent()
    logging.basicConfig(level=log_level, format=f"%(asctime)s worker{index} %(name)s %(message)s")
    try:
        run_one(config, opts, index=index, ready=lambda line: q.put((index, "ready", line)))
    except UserError as e:
        q.put((index, "error", str(e)))
        sys.exit(2)


def _die_with_parent() -> None:
    """Linux: have the kernel send SIGTERM to this process when its parent dies."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclasses.dataclass(frozen=True)
class ProxySpec:
    """The front of a disaggregated pair (serve/pd_proxy.py): its workers' URLs and its address."""

    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    host: str
    port: int
    http: HttpLimits


def _proxy_main(spec: ProxySpec, index: int, log_level: int, q) -> None:
    """A child process: the disaggregation proxy until SIGTERM, reporting ready (or the error) on `q`."""
    from agentkv.serve.pd_proxy import PDProxy

    _die_with_parent()
    logging.basicConfig(level=log_level, format="%(asctime)s proxy %(name)s %(message)s")

    async def main() -> None:
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        proxy = PDProxy(spec.prefill, spec.decode, spec.host, spec.port, spec.http)
        try:
            url = await proxy.start()
        except OSError as e:
            q.put((index, "error", f"cannot listen on {spec.host}:{spec.port}: {e.strerror}"))
            return
        q.put((index, "ready", f"proxy: {url}  prefill={len(spec.prefill)} decode={len(spec.decode)}"))
        try:
            await stop.wait()
        finally:
            await proxy.stop()

    asyncio.run(main())


def run_workers(config: EngineConfig, options: list[ServeOptions], front: ProxySpec | None = None) -> int:
    """Start one child per options, print each once ready, stop all on a signal or a death. `front`:
    a disaggregation proxy started once every worker is up (one more child)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    level = logging.getLogger().level
    procs = [
        ctx.Process(target=_worker_main, args=(config, o, i, level, q), name=f"agentkv-worker-{i}")
        for i, o in enumerate(options)
    ]
    if front is not None:
        n = len(procs)
        procs.append(ctx.Process(target=_proxy_main, args=(front, n, level, q), name="agentkv-proxy"))
    stopping = False

    def on_signal(signum, frame) -> None:
        nonlocal stopping
        stopping = True

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    rc = 0
    try:
        for p in procs:
            p.start()
        pending = set(range(len(procs)))
        while not stopping:
            try:
                index, kind, msg = q.get(timeout=0.2)
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if not p.is_alive()]
                if dead:
                    print(
                        f"agentkv serve: {_who(procs, dead[0])} exited (code {procs[dead[0]].exitcode}); "
                        "stopping the others",
                        file=sys.stderr,
                        flush=True,
                    )
                    rc = 1
                    break
                continue
            if kind == "error":
                print(f"agentkv: error: {_who(procs, index)}: {msg}", file=sys.stderr, flush=True)
                rc = 2
                break
            pending.discard(index)
            print(f"agentkv serve: {msg}  pid={procs[index].pid}", flush=True)
            if not pending:
                print(f"agentkv serve: {len(options)} workers up; Ctrl-C stops them all", flush=True)
    finally:
        _stop_all(procs)
        for s, h in old.items():
            signal.signal(s, h)
        q.close()
    return rc


def _who(procs: list, index: int) -> str:
    return "the proxy" if procs[index].name == "agentkv-proxy" else f"worker {index}"


def _stop_all(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            with contextlib.suppress(ProcessLookupError):
                p.terminate()
    deadline = time.monotonic() + GRACE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(2.0)
