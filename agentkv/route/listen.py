"""`agentkv route` as a process: the router's app behind the door's connection guard, its two proxied
endpoints on the lean server path (gate/fastpath.py), on uvloop when installed, until SIGINT or SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

from agentkv.errors import UserError
from agentkv.gate.conn import make_runner, start_site
from agentkv.route.proxy import Router, RouterConfig

log = logging.getLogger("agentkv.route")


def fast_paths(router: Router) -> dict:
    """The proxied endpoints, answered by gate.fastpath ahead of aiohttp (plain small requests)."""
    return {"/v1/completions": router.fast, "/v1/chat/completions": router.fast}


def run_router(cfg: RouterConfig) -> None:
    """Serve until interrupted (under `--processes N`, on a port shared with the others)."""
    router = Router(cfg)
    log.info(
        "agentkv route on http://%s:%d, policy %s, %d workers%s",
        cfg.host,
        cfg.port,
        cfg.policy,
        len(cfg.workers),
        "" if cfg.process is None else f" (process {cfg.process}, pid {os.getpid()})",
    )
    loop_factory = asyncio.new_event_loop
    try:  # uvloop when present: about a third less CPU per proxied request
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        pass
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(_serve(router, cfg, cfg.process is not None))


async def _serve(router: Router, cfg: RouterConfig, shared: bool) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    runner = make_runner(router.app, cfg.http)
    await runner.setup()
    try:
        # each client connection may hold one to its worker: two descriptors per connection
        router.guard = await start_site(
            runner,
            cfg.host,
            cfg.port,
            cfg.http,
            fds_per_connection=2,
            reuse_port=shared,
            fast=fast_paths(router),
        )
    except OSError as e:
        await runner.cleanup()
        raise UserError(f"cannot listen on {cfg.host}:{cfg.port}: {e.strerror}") from None
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
