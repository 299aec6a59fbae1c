"""`agentkv route --processes N`: N router processes on one port (SO_REUSEPORT), one per core.

The parent validates the flags, makes sure every child has the same router secret (a random one
in the environment when none is given, so tenant salts and session tie-breaks agree), starts N
children and then only waits: SIGTERM or SIGINT is forwarded to each child by pid, and a child
that exits on its own stops the rest (the exit status says which failed). Each child is a whole
router: its own event loop, KV-event subscribers, health checks and parser processes; the
kernel spreads new connections over them. A child dies with its parent (PR_SET_PDEATHSIG).
`/metrics`, answered by whichever process the scrape reaches, holds every process's series with a
`process` label: each leaves its page in a private folder every second for the others to read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time

from agentkv.errors import UserError
from agentkv.gate.work import die_with_parent
from agentkv.route.tenants import SECRET_ENV

log = logging.getLogger("agentkv.route")
STOP_GRACE_S = 15.0  # a child still running this long after SIGTERM is killed


def _child(cfg, index: int, level: str, parent: int) -> None:
    """One router process (the target of each child)."""
    die_with_parent(parent)
    logging.basicConfig(level=level, format=f"%(asctime)s %(name)s[{index}] %(levelname)s %(message)s")
    from agentkv.route.listen import run_router

    try:
        run_router(dataclasses.replace(cfg, process=index))
    except UserError as e:
        print(f"agentkv: error: {e}", file=sys.stderr)
        sys.exit(2)


def _check_port_free(host: str, port: int) -> None:
    """UserError when host:port is taken: the children share it through SO_REUSEPORT, so a listener
    there that set it too (another `--processes` router) would otherwise take half the traffic."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.create_server((host, port), family=family):
            pass
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port}: {os.strerror(e.errno) if e.errno else e}") from None


def run_processes(cfg, n: int, level: str) -> int:
    """Start `n` router processes on cfg.port and wait for them; the exit status."""
    if cfg.port == 0:
        raise UserError("--processes over 1 needs a fixed --port (each process would pick its own)")
    _check_port_free(cfg.host, cfg.port)
    if cfg.secret is None and not os.environ.get(SECRET_ENV):
        os.environ[SECRET_ENV] = secrets.token_hex(32)  # inherited: one secret for all children
    ctx = mp.get_context("spawn")
    cfg = dataclasses.replace(cfg, metrics_dir=tempfile.mkdtemp(prefix="agentkv-route-metrics-"))
    children = [
        ctx.Process(target=_child, args=(cfg, k, level, os.getpid()), name=f"route-{k}") for k in range(n)
    ]
    stopping = False

    def stop(signum=signal.SIGTERM, frame=None) -> None:
        nonlocal stopping
        stopping = True
        for p in children:
            if p.pid is not None and p.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM)

    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for p in children:
            p.start()
        log.info(
            "agentkv route: %d processes on http://%s:%d (pids %s)",
            n,
            cfg.host,
            cfg.port,
            " ".join(str(p.pid) for p in children),
        )
        return _wait(children, stop, lambda: stopping)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        shutil.rmtree(cfg.metrics_dir, ignore_errors=True)


def _wait(children: list, stop, stopping) -> int:
    """Until every child has exited; the first that exits unasked stops the others."""
    failed = 0
    while any(p.exitcode is None for p in children):
        for p in children:
            p.join(0.2)
            if p.exitcode is not None and not stopping():
                failed = p.exitcode or 1
                log.error(
                    "router process %s (pid %d) exited with %s; stopping the others",
                    p.name,
                    p.pid,
                    p.exitcode,
                )
                stop()
        if stopping():
            deadline = time.monotonic() + STOP_GRACE_S
            for p in children:
                p.join(max(0.0, deadline - time.monotonic()))
                if p.exitcode is None:
                    log.warning("router process %s (pid %d) did not stop; killing it", p.name, p.pid)
                    p.kill()
                    p.join(5)
    return failed
