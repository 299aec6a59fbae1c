"""`agentkv bench --clients N --ray [ADDRESS]`: each client shard a Ray actor (one CPU, spread over the
nodes) running the same ShardRun as a local shard process, speaking the same messages
(agentkv.bench.shard_worker): clock pings are actor calls, and the driver takes the records each actor
holds in its outbox as they finish (a long poll), not at the end. Ray itself: agentkv.scaleout.raytasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
from collections.abc import Iterator
from urllib.parse import urlsplit

from agentkv.bench.shard_worker import ENDS, ShardRun, clock_reply, play
from agentkv.errors import UserError
from agentkv.scaleout.raytasks import connect, import_ray

START_S = 120.0  # an actor must start (a worker process on some node) and answer within this
POLL_S = 0.5  # the longest a take waits for the actor's next message
LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


class Outbox:
    """A shard actor's messages until the driver takes them: the `send` end ShardRun writes to."""

    def __init__(self):
        self._cv = threading.Condition()
        self._msgs: list[tuple] = []

    def send(self, msg: tuple) -> None:
        with self._cv:
            self._msgs.append(msg)
            self._cv.notify_all()

    def take(self, wait: float) -> list[tuple]:
        """Every message held, in order; waits up to `wait` seconds for one when none is."""
        with self._cv:
            self._cv.wait_for(lambda: self._msgs, wait)
            out, self._msgs = self._msgs, []
        return out


class ShardActor:
    """One client shard in a Ray actor (a threaded actor: `take` and `stop` run beside the run)."""

    def __init__(self, cfg, traces, marker: str | None, loop: str):
        self.box, self.loop, self.error = Outbox(), loop, ""
        self.aloop = self.task = None
        self.stopping = False
        try:
            self.run = ShardRun(cfg, traces, self.box, marker)
        except UserError as e:
            self.run, self.error = None, str(e)

    def where(self) -> tuple[str, str, int]:
        """(node address, host name, pid) of this actor."""
        import ray

        return ray.util.get_node_ip_address(), socket.gethostname(), os.getpid()

    def ping(self) -> tuple:
        return ("error", self.error) if self.error else clock_reply()

    def go(self) -> None:
        threading.Thread(
            target=play, args=(self.run, self._on_loop), name="agentkv-shard", daemon=True
        ).start()

    def _on_loop(self, coro):
        """The run on its own event loop in this thread (no signal handlers: `stop` cancels it)."""
        from agentkv.bench.live import loop_factory

        with asyncio.Runner(loop_factory=loop_factory(self.loop)) as runner:
            return runner.run(self._main(coro))

    async def _main(self, coro):
        self.aloop, self.task = asyncio.get_running_loop(), asyncio.current_task()
        if self.stopping:
            coro.close()
            raise asyncio.CancelledError
        return await coro

    def take(self, wait: float) -> list[tuple]:
        return self.box.take(wait)

    def stop(self) -> None:
        """As SIGTERM to a shard process: the run stops, keeps what finished and says it ended."""
        self.stopping = True
        if self.aloop is not None:
            self.aloop.call_soon_threadsafe(self.task.cancel)


def _why(e: BaseException) -> str:
    """A Ray error in one line: its type and first sentence."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}".rstrip(": ")


class RayShards:
    """The driver's side: join the cluster, one actor per shard, then leave (actors killed)."""

    def __init__(self, address: str):
        self.ray, self.address, self.actors = import_ray(address), address, []
        connect(self.ray, address)

    def start(self, parts, marker: str | None, loop: str, target: str) -> list[RayLink]:
        """An actor per (config, traces) part, every one started and placed before any link returns."""
        ray, n = self.ray, len(parts)
        cpus = ray.cluster_resources().get("CPU", 0)
        if cpus < n:
            raise UserError(
                f"--clients {n} --ray: a shard actor takes one CPU and the Ray cluster has {cpus:g}"
            )
        cls = ray.remote(
            num_cpus=1, max_restarts=0, max_task_retries=0, max_concurrency=4, scheduling_strategy="SPREAD"
        )(ShardActor)
        self.actors = [cls.remote(c, part, marker, loop) for c, part in parts]
        try:
            wheres = ray.get([a.where.remote() for a in self.actors], timeout=START_S)
        except ray.exceptions.GetTimeoutError:
            raise UserError(
                f"--ray: the {n} shard actors did not all start within {START_S:g} s (is the cluster busy?)"
            ) from None
        except ray.exceptions.RayError as e:
            raise UserError(f"--ray: a shard actor did not start ({_why(e)})") from None
        links = [RayLink(ray, i, a, *w) for i, (a, w) in enumerate(zip(self.actors, wheres, strict=True))]
        check_reachable(target, links)
        return links

    def close(self) -> None:
        for a in self.actors:
            with contextlib.suppress(Exception):  # already gone, or the cluster is
                self.ray.kill(a)
        self.ray.shutdown()


def check_reachable(target: str, links: list) -> None:
    """A UserError when the target listens on this machine's loopback and a shard runs elsewhere."""
    host = urlsplit(target).hostname or ""
    if host not in LOOPBACK and not host.startswith("127."):
        return
    here = socket.gethostname()
    for x in links:
        if x.hostname != here:
            raise UserError(
                f"--ray: client shard {x.index} runs on node {x.node} ({x.hostname}), which cannot reach "
                f"{target} on this machine's loopback: give a --target address the cluster's nodes can reach"
            )


class RayLink:
    """The driver's end of one shard actor (as ProcessLink is of a shard process)."""

    def __init__(self, ray, index: int, actor, node: str, hostname: str, pid: int):
        self.ray, self.index, self.actor = ray, index, actor
        self.node, self.hostname, self.pid = node, hostname, pid
        self.where = f"Ray actor on {node}, pid {pid}"
        self.death = ""

    def ping(self) -> tuple:
        try:
            return self.ray.get(self.actor.ping.remote(), timeout=START_S)
        except self.ray.exceptions.RayError as e:
            raise UserError(
                f"client shard {self.index} ({self.where}) died before its run started ({_why(e)})"
            ) from None

    def go(self) -> None:
        self.actor.go.remote()

    def messages(self) -> Iterator[tuple]:
        """The actor's messages as it sends them, up to its last; ends early when the actor dies."""
        while True:
            try:
                batch = self.ray.get(self.actor.take.remote(POLL_S))
            except Exception as e:  # the actor's process or node is gone (RayActorError), or the cluster
                self.death = _why(e)
                return
            for msg in batch:
                yield msg
                if msg[0] in ENDS:
                    return

    def gone(self) -> str:
        return self.death or "its actor ended without saying how"

    def stop(self) -> None:
        with contextlib.suppress(Exception):  # a dead actor has nothing to stop
            self.actor.stop.remote()

    def close(self) -> None:
        """Nothing here: RayShards.close kills every actor and leaves the cluster."""
